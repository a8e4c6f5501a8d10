package etcdstore

import (
	"errors"
	"testing"
)

func TestFingerprintOf(t *testing.T) {
	same := [][2]string{
		{`{"a":1,"b":[1,2]}`, "{\"b\":[1,2],\n\"a\":1.0}"},
		{`not json`, `not json`},
		{``, ``},
	}
	for _, p := range same {
		if fpOf(t, p[0]) != fpOf(t, p[1]) {
			t.Errorf("FingerprintOf(%q) != FingerprintOf(%q); want equal", p[0], p[1])
		}
	}
	differ := [][2]string{
		{`{"a":1}`, `{"a":2}`},
		{`{"a":1}`, `{"a":"1"}`},
		{`[1,2]`, `[2,1]`},
		{`not json`, `not json `},
		{`12345678901234567890`, `12345678901234567891`},
		{`{"a":1}`, `{"a":1}x`}, // the second is not JSON: raw bytes
	}
	for _, p := range differ {
		if fpOf(t, p[0]) == fpOf(t, p[1]) {
			t.Errorf("FingerprintOf(%q) == FingerprintOf(%q); want different", p[0], p[1])
		}
	}
	if _, err := FingerprintOf([]byte(`{"a":1,"a":2}`)); !errors.Is(err, ErrInvalidParams) {
		t.Errorf("duplicate member: %v; want ErrInvalidParams", err)
	}
}
