package etcdstore

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// Fingerprint is the SHA-256 of a request's parameters in canonical form. It
// is stored with the claim; a later request with the same key and a different
// fingerprint is refused with ErrMismatch.
type Fingerprint [sha256.Size]byte

// String returns the fingerprint in hex.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// FingerprintOf fingerprints params: in canonical JSON form when params is
// valid UTF-8 JSON (so whitespace and object key order do not matter), and as
// raw bytes otherwise. It returns an error wrapping ErrInvalidParams for
// JSON that has no single canonical form (see CanonicalJSON).
func FingerprintOf(params []byte) (Fingerprint, error) {
	if utf8.Valid(params) && json.Valid(params) {
		c, err := CanonicalJSON(params)
		if err != nil {
			return Fingerprint{}, err
		}
		return sha256.Sum256(c), nil
	}
	return sha256.Sum256(params), nil
}

// maxJSONDepth bounds nesting so hostile input cannot exhaust the stack.
const maxJSONDepth = 256

// CanonicalJSON returns b in a canonical form close to RFC 8785 (JCS): no
// insignificant whitespace, object members sorted by their UTF-16 code
// units, strings escaped minimally, numbers in one spelling. It refuses, with
// an error wrapping ErrInvalidParams, input that is not a single JSON value
// in valid UTF-8, objects with a repeated member name (parsers disagree on
// which one wins), nesting deeper than 256, and non-integer numbers that a
// float64 round trip would change (1e400, 0.1000000000000000000001): two
// different such numbers would otherwise share one canonical form. Integer
// literals are kept digit for digit, so large ids survive.
func CanonicalJSON(b []byte) ([]byte, error) {
	if !utf8.Valid(b) {
		return nil, fmt.Errorf("%w: JSON is not valid UTF-8", ErrInvalidParams)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var out bytes.Buffer
	out.Grow(len(b))
	if err := canonValue(dec, &out, 0); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%w: data after the JSON value", ErrInvalidParams)
	}
	return out.Bytes(), nil
}

func canonValue(dec *json.Decoder, out *bytes.Buffer, depth int) error {
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("%w: malformed JSON: %v", ErrInvalidParams, err)
	}
	return canonToken(dec, out, tok, depth)
}

func canonToken(dec *json.Decoder, out *bytes.Buffer, tok json.Token, depth int) error {
	if depth > maxJSONDepth {
		return fmt.Errorf("%w: JSON nested deeper than %d", ErrInvalidParams, maxJSONDepth)
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			return canonObject(dec, out, depth+1)
		case '[':
			out.WriteByte('[')
			for i := 0; dec.More(); i++ {
				if i > 0 {
					out.WriteByte(',')
				}
				if err := canonValue(dec, out, depth+1); err != nil {
					return err
				}
			}
			if _, err := dec.Token(); err != nil { // ']'
				return fmt.Errorf("%w: malformed JSON: %v", ErrInvalidParams, err)
			}
			out.WriteByte(']')
			return nil
		}
		return fmt.Errorf("%w: malformed JSON: unexpected %v", ErrInvalidParams, v)
	case string:
		writeJSONString(out, v)
	case json.Number:
		n, err := canonNumber(string(v))
		if err != nil {
			return err
		}
		out.WriteString(n)
	case bool:
		out.WriteString(strconv.FormatBool(v))
	case nil:
		out.WriteString("null")
	default:
		return fmt.Errorf("%w: malformed JSON: unexpected token %v", ErrInvalidParams, tok)
	}
	return nil
}

func canonObject(dec *json.Decoder, out *bytes.Buffer, depth int) error {
	type member struct {
		name  string
		value []byte
	}
	var members []member
	seen := make(map[string]bool)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return fmt.Errorf("%w: malformed JSON: %v", ErrInvalidParams, err)
		}
		name, ok := tok.(string)
		if !ok {
			return fmt.Errorf("%w: malformed JSON: object member name %v", ErrInvalidParams, tok)
		}
		if seen[name] {
			return fmt.Errorf("%w: JSON object repeats member %q", ErrInvalidParams, name)
		}
		seen[name] = true
		var v bytes.Buffer
		if err := canonValue(dec, &v, depth); err != nil {
			return err
		}
		members = append(members, member{name, v.Bytes()})
	}
	if _, err := dec.Token(); err != nil { // '}'
		return fmt.Errorf("%w: malformed JSON: %v", ErrInvalidParams, err)
	}
	slices.SortFunc(members, func(a, b member) int { return compareUTF16(a.name, b.name) })
	out.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			out.WriteByte(',')
		}
		writeJSONString(out, m.name)
		out.WriteByte(':')
		out.Write(m.value)
	}
	out.WriteByte('}')
	return nil
}

// compareUTF16 orders strings by UTF-16 code units, as RFC 8785 requires.
func compareUTF16(a, b string) int {
	return slices.Compare(utf16.Encode([]rune(a)), utf16.Encode([]rune(b)))
}

// canonNumber spells a JSON number one way. Integer literals stay as written
// (JSON forbids leading zeros, so that is already unique), except "-0".
// Others take Go's shortest float64 round-trip form, with integral values of
// magnitude below 2^53 written as integers so that 1.0, 1e0 and 1 agree. A
// number whose canonical form has a different decimal value than its literal
// (it cannot round-trip through JSON's usual float64) is refused: two
// different numbers would share one fingerprint.
func canonNumber(s string) (string, error) {
	if !strings.ContainsAny(s, ".eE") {
		if s == "-0" {
			return "0", nil
		}
		return s, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsInf(f, 0) {
		return "", fmt.Errorf("%w: JSON number %s is out of range", ErrInvalidParams, s)
	}
	var c string
	switch {
	case f == 0:
		c = "0"
	case f == math.Trunc(f) && math.Abs(f) < 1<<53:
		c = strconv.FormatInt(int64(f), 10)
	default:
		c = strconv.FormatFloat(f, 'g', -1, 64)
	}
	lit, ok1 := new(big.Rat).SetString(s)
	can, ok2 := new(big.Rat).SetString(c)
	if !ok1 || !ok2 || lit.Cmp(can) != 0 {
		return "", fmt.Errorf("%w: JSON number %s does not survive a float64 round trip (it would read as %s); send it as a string", ErrInvalidParams, s, c)
	}
	return c, nil
}

func writeJSONString(out *bytes.Buffer, s string) {
	out.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"':
			out.WriteString(`\"`)
		case r == '\\':
			out.WriteString(`\\`)
		case r == '\b':
			out.WriteString(`\b`)
		case r == '\f':
			out.WriteString(`\f`)
		case r == '\n':
			out.WriteString(`\n`)
		case r == '\r':
			out.WriteString(`\r`)
		case r == '\t':
			out.WriteString(`\t`)
		case r < 0x20:
			fmt.Fprintf(out, `\u%04x`, r)
		default:
			out.WriteRune(r)
		}
	}
	out.WriteByte('"')
}
