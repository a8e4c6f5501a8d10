package canonjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/big"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestCanonical(t *testing.T) {
	tests := []struct{ in, want string }{
		{`{"b":1,"a":2}`, `{"a":2,"b":1}`},
		{" {\n\"a\" : [ 1 , 2 ] } ", `{"a":[1,2]}`},
		{`{"a":{"d":null,"c":true}}`, `{"a":{"c":true,"d":null}}`},
		{`1.0`, `1`},
		{`1e2`, `100`},
		{`-0`, `0`},
		{`-0.0`, `0`},
		{`0.5`, `0.5`},
		{`0.1`, `0.1`},
		{`[19.99, 1.10, 2.5E-3]`, `[19.99,1.1,0.0025]`},
		{`1.5e300`, `1.5e+300`},
		{`12345678901234567890123`, `12345678901234567890123`}, // big integer ids survive
		{`"\u00e9\u0041\/"`, `"éA/"`},
		{`"<&>\u2028"`, "\"<&>\u2028\""}, // no HTML escaping
		{`"\u0001\t"`, `"\u0001\t"`},
		// RFC 8785 orders members by UTF-16 code units: U+FF61 (one unit)
		// sorts after U+1F600 (surrogates D83D DE00).
		{`{"｡":1,"😀":2}`, `{"😀":2,"｡":1}`},
	}
	for _, tt := range tests {
		got, err := Canonical([]byte(tt.in))
		if err != nil || string(got) != tt.want {
			t.Errorf("Canonical(%s) = %s, %v; want %s", tt.in, got, err, tt.want)
		}
	}
}

func TestCanonicalJSONRejects(t *testing.T) {
	for _, in := range []string{
		`{"a":1,"a":1}`,
		`{"a":{"b":1,"b":2}}`,
		`1e400`,
		`-1e400`,
		`0.1000000000000000000001`,
		`{"a":1} {"b":2}`,
		`{"a":1`,
		"\"\xff\"",
		strings.Repeat("[", maxJSONDepth+2) + strings.Repeat("]", maxJSONDepth+2),
	} {
		if _, err := Canonical([]byte(in)); !refused(err) {
			t.Errorf("Canonical(%.40q) error = %v; want ErrNoCanonicalForm", in, err)
		}
	}
}

func FuzzCanonical(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":[1,2.5,"x"]}`, `1e2`, `"\u00e9"`, `{"a":{"b":null}}`, `[]`, `-0.0`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Canonical(b)
		if err != nil {
			if !refused(err) {
				t.Fatalf("error %v does not wrap ErrNoCanonicalForm", err)
			}
			return
		}
		// The canonical form is a fixed point.
		c2, err := Canonical(c)
		if err != nil || string(c2) != string(c) {
			t.Fatalf("not idempotent: %q -> %q -> %q, %v", b, c, c2, err)
		}
	})
}

func TestCanonicalJSONStrings(t *testing.T) {
	for in, want := range map[string]string{
		`"\ud83d\ude00"`: `"😀"`, // a surrogate pair is one rune
		`"a\/b"`:         `"a/b"`,
		`"\u00e9"`:       `"é"`,
		`"tab\there"`:    `"tab\there"`,
	} {
		if got, err := Canonical([]byte(in)); err != nil || string(got) != want {
			t.Errorf("Canonical(%s) = %s, %v; want %s", in, got, err, want)
		}
	}
	for _, in := range []string{`"\ud83d"`, `"\ude00"`, `"\ud83dx"`, "\"a\x01b\"", `"\x"`, `01`, `1.`, `.1`, `-`, `1e`, `[1,]`, `{"a" 1}`, `tru`} {
		if _, err := Canonical([]byte(in)); !refused(err) {
			t.Errorf("Canonical(%q) = %v; want ErrNoCanonicalForm", in, err)
		}
	}
}

// FuzzCanonicalJSONAgrees checks the canonicaliser against encoding/json:
// what it accepts is valid JSON meaning the same value, and what valid JSON
// it refuses, it refuses for a documented reason.
func FuzzCanonicalJSONAgrees(f *testing.F) {
	for _, s := range []string{`{"b":[1,2.5e3,"x\n"],"a":{"c":null,"d":true}}`, `"\ud83d\ude00"`, `-0.0`, `[]`, `{}`, `1E+2`, ` [ 1 , "a" ] `} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Canonical(b)
		if err != nil {
			// encoding/json accepts invalid UTF-8 in strings; JSON (RFC 8259)
			// does not, and neither does the canonicaliser.
			if json.Valid(b) && utf8.Valid(b) && errors.Is(err, ErrNotJSON) {
				t.Fatalf("%q is valid JSON but was refused as not JSON: %v", b, err)
			}
			return
		}
		if !json.Valid(b) || !json.Valid(c) {
			t.Fatalf("accepted %q -> %q, but encoding/json finds one of them invalid", b, c)
		}
		x, errX := exactValue(b)
		y, errY := exactValue(c)
		if errX != nil || errY != nil || !reflect.DeepEqual(x, y) {
			t.Fatalf("%q and its canonical form %q mean different values (%v, %v)", b, c, errX, errY)
		}
	})
}

// exactValue decodes JSON with numbers as exact rationals.
func exactValue(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	var norm func(any) any
	norm = func(v any) any {
		switch x := v.(type) {
		case json.Number:
			r, _ := new(big.Rat).SetString(string(x))
			return r.RatString()
		case []any:
			for i := range x {
				x[i] = norm(x[i])
			}
		case map[string]any:
			for k := range x {
				x[k] = norm(x[k])
			}
		}
		return v
	}
	return norm(v), nil
}

// refused reports whether err is one of Canonical's refusals.
func refused(err error) bool {
	return errors.Is(err, ErrNoCanonicalForm) || errors.Is(err, ErrNotJSON)
}
