package idemclient_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/idem-dev/idem/idemclient"
)

// docs/GRPC.md, "A retrying HTTP client": "Every error names the key:
// idemclient.KeyOf(err)". The key is chosen (the caller's, here) before the
// request body is read, but an error reading it, or a body over
// MaxBufferedBody without GetBody, comes back without it.
func TestReviewEveryErrorNamesTheKey(t *testing.T) {
	s := newScript(t, []int{200}, nil)
	client := &http.Client{Transport: &idemclient.Transport{}}
	for name, body := range map[string]io.Reader{
		"a body that fails to read": io.MultiReader(strings.NewReader(`{"amount":`), iotest.ErrReader(errors.New("disk read error"))),
		"a body over 16 MiB":        io.MultiReader(bytes.NewReader(make([]byte, idemclient.MaxBufferedBody)), strings.NewReader("x")),
	} {
		ctx := idemclient.WithKey(context.Background(), "order-1234")
		req, err := http.NewRequestWithContext(ctx, "POST", s.URL+"/charges", body)
		if err != nil {
			t.Fatal(err)
		}
		_, err = client.Do(req)
		if err == nil {
			t.Fatalf("%s: no error", name)
		}
		if key, ok := idemclient.KeyOf(err); !ok || key != "order-1234" {
			t.Errorf("%s: error %q names no key (KeyOf = %q, %v)", name, err, key, ok)
		}
	}
}

// KeyOf must never name a key the operation did not use. A Worker's calls
// carry their key in the body, yet a failed call's error is a KeyError
// naming a fresh UUID that the Transport generated and never sent: a
// caller that retries "with the key the error names" (as the docs say)
// retries another operation.
func TestReviewWorkerErrorsDoNotNameAForeignKey(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens: connection refused
	w, err := idemclient.NewWorker("http://"+addr, &idemclient.Transport{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = w.Claim(context.Background(), "order-1", json.RawMessage(`{"amount":1}`), idemclient.ClaimOptions{})
	if err == nil {
		t.Fatal("a claim with nothing listening succeeded")
	}
	if key, ok := idemclient.KeyOf(err); ok && key != "order-1" {
		t.Fatalf("Worker.Claim(order-1) failed with %q; KeyOf names %q, a key nobody sent", err, key)
	}
}
