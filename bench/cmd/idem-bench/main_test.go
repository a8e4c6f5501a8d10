package main

import (
	"context"
	"errors"
	"flag"
	"io"
	"testing"
)

// Help asked for is not an error (exit 0); a bad flag is a usage error
// (exit 2).
func TestHelpAndUsage(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"--help"}} {
		if err := bench(context.Background(), args, io.Discard, io.Discard); !errors.Is(err, flag.ErrHelp) {
			t.Errorf("idem-bench %v = %v; want flag.ErrHelp (exit 0)", args, err)
		}
	}
	if err := bench(context.Background(), []string{"--no-such-flag"}, io.Discard, io.Discard); !errors.As(err, new(usageError)) {
		t.Errorf("idem-bench --no-such-flag = %v; want a usage error (exit 2)", err)
	}
}
