// Package canonjson puts JSON in one canonical form, close to RFC 8785
// (the JSON Canonicalization Scheme), so that two requests whose parameters
// differ only in whitespace, member order or number spelling get one
// fingerprint.
package canonjson

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// ErrNotJSON marks input that is not JSON at all.
var ErrNotJSON = errors.New("not JSON")

// ErrNoCanonicalForm marks JSON that has no single canonical form: a
// repeated member name, a lone surrogate escape, nesting too deep, a number
// a float64 round trip would change. Every error of Canonical wraps it or
// ErrNotJSON.
var ErrNoCanonicalForm = errors.New("JSON has no canonical form")

// maxJSONDepth bounds nesting so hostile input cannot exhaust the stack.
const maxJSONDepth = 256

// Canonical returns b in a canonical form close to RFC 8785 (JCS): no
// insignificant whitespace, object members sorted by their UTF-16 code
// units, strings escaped minimally, numbers in one spelling. It refuses
// input that is not a single JSON value
// in valid UTF-8, strings with lone surrogate escapes, objects with a
// repeated member name (parsers disagree on which one wins), nesting deeper
// than 256, and non-integer numbers that a float64 round trip would change
// (1e400, 0.1000000000000000000001): two different such numbers would
// otherwise share one canonical form. Integer literals are kept digit for
// digit, so large ids survive.
func Canonical(b []byte) ([]byte, error) {
	if !utf8.Valid(b) {
		return nil, fmt.Errorf("%w: JSON is not valid UTF-8", ErrNotJSON)
	}
	p := jsonParser{in: b, out: make([]byte, 0, len(b))}
	p.skipSpace()
	if err := p.value(0); err != nil {
		return nil, err
	}
	p.skipSpace()
	if p.pos != len(p.in) {
		return nil, p.syntax("data after the JSON value")
	}
	return p.out, nil
}

// jsonParser canonicalises JSON in one pass over the bytes.
type jsonParser struct {
	in  []byte
	pos int
	out []byte
}

func (p *jsonParser) syntax(what string) error {
	return fmt.Errorf("%w: malformed JSON at offset %d: %s", ErrNotJSON, p.pos, what)
}

func (p *jsonParser) skipSpace() {
	for p.pos < len(p.in) {
		switch p.in[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *jsonParser) value(depth int) error {
	if depth > maxJSONDepth {
		return fmt.Errorf("%w: JSON nested deeper than %d", ErrNoCanonicalForm, maxJSONDepth)
	}
	if p.pos >= len(p.in) {
		return p.syntax("unexpected end")
	}
	switch c := p.in[p.pos]; {
	case c == '{':
		return p.object(depth + 1)
	case c == '[':
		return p.array(depth + 1)
	case c == '"':
		str, err := p.str()
		if err != nil {
			return err
		}
		p.out = AppendString(p.out, str)
		return nil
	case c == '-' || c >= '0' && c <= '9':
		return p.number()
	}
	for _, lit := range []string{"true", "false", "null"} {
		if bytes.HasPrefix(p.in[p.pos:], []byte(lit)) {
			p.pos += len(lit)
			p.out = append(p.out, lit...)
			return nil
		}
	}
	return p.syntax("unexpected character")
}

func (p *jsonParser) array(depth int) error {
	p.pos++ // [
	p.out = append(p.out, '[')
	p.skipSpace()
	if p.pos < len(p.in) && p.in[p.pos] == ']' {
		p.pos++
		p.out = append(p.out, ']')
		return nil
	}
	for {
		p.skipSpace()
		if err := p.value(depth); err != nil {
			return err
		}
		p.skipSpace()
		if p.pos >= len(p.in) {
			return p.syntax("unterminated array")
		}
		switch p.in[p.pos] {
		case ',':
			p.pos++
			p.out = append(p.out, ',')
		case ']':
			p.pos++
			p.out = append(p.out, ']')
			return nil
		default:
			return p.syntax("expected , or ] in an array")
		}
	}
}

func (p *jsonParser) object(depth int) error {
	p.pos++ // {
	type member struct {
		name  string
		value []byte
	}
	var members []member
	p.skipSpace()
	if p.pos < len(p.in) && p.in[p.pos] == '}' {
		p.pos++
		p.out = append(p.out, '{', '}')
		return nil
	}
	outer := p.out
	for {
		p.skipSpace()
		if p.pos >= len(p.in) || p.in[p.pos] != '"' {
			return p.syntax("expected a member name")
		}
		name, err := p.str()
		if err != nil {
			return err
		}
		for _, m := range members {
			if m.name == name {
				return fmt.Errorf("%w: JSON object repeats member %q", ErrNoCanonicalForm, name)
			}
		}
		p.skipSpace()
		if p.pos >= len(p.in) || p.in[p.pos] != ':' {
			return p.syntax("expected : after a member name")
		}
		p.pos++
		p.skipSpace()
		p.out = nil
		if err := p.value(depth); err != nil {
			return err
		}
		members = append(members, member{name, p.out})
		p.skipSpace()
		if p.pos >= len(p.in) {
			return p.syntax("unterminated object")
		}
		if p.in[p.pos] == '}' {
			p.pos++
			break
		}
		if p.in[p.pos] != ',' {
			return p.syntax("expected , or } in an object")
		}
		p.pos++
	}
	slices.SortFunc(members, func(a, b member) int { return compareUTF16(a.name, b.name) })
	p.out = append(outer, '{')
	for i, m := range members {
		if i > 0 {
			p.out = append(p.out, ',')
		}
		p.out = AppendString(p.out, m.name)
		p.out = append(p.out, ':')
		p.out = append(p.out, m.value...)
	}
	p.out = append(p.out, '}')
	return nil
}

// str reads a string literal and returns its value.
func (p *jsonParser) str() (string, error) {
	p.pos++ // "
	start := p.pos
	// Fast path: no escapes.
	for p.pos < len(p.in) {
		c := p.in[p.pos]
		if c == '"' {
			s := string(p.in[start:p.pos])
			p.pos++
			return s, nil
		}
		if c == '\\' || c < 0x20 {
			break
		}
		p.pos++
	}
	var b []byte
	b = append(b, p.in[start:p.pos]...)
	for p.pos < len(p.in) {
		c := p.in[p.pos]
		switch {
		case c == '"':
			p.pos++
			return string(b), nil
		case c < 0x20:
			return "", p.syntax("control character in a string")
		case c != '\\':
			b = append(b, c)
			p.pos++
			continue
		}
		if p.pos+1 >= len(p.in) {
			return "", p.syntax("unterminated escape")
		}
		e := p.in[p.pos+1]
		p.pos += 2
		switch e {
		case '"', '\\', '/':
			b = append(b, e)
		case 'b':
			b = append(b, '\b')
		case 'f':
			b = append(b, '\f')
		case 'n':
			b = append(b, '\n')
		case 'r':
			b = append(b, '\r')
		case 't':
			b = append(b, '\t')
		case 'u':
			r, ok := p.hex4()
			if !ok {
				return "", p.syntax("bad \\u escape")
			}
			if utf16.IsSurrogate(r) {
				if r >= 0xdc00 || p.pos+1 >= len(p.in) || p.in[p.pos] != '\\' || p.in[p.pos+1] != 'u' {
					return "", fmt.Errorf("%w: JSON string has a lone surrogate escape", ErrNoCanonicalForm)
				}
				p.pos += 2
				r2, ok := p.hex4()
				if !ok || r2 < 0xdc00 || r2 > 0xdfff {
					return "", fmt.Errorf("%w: JSON string has a lone surrogate escape", ErrNoCanonicalForm)
				}
				r = utf16.DecodeRune(r, r2)
			}
			b = utf8.AppendRune(b, r)
		default:
			return "", p.syntax("bad escape")
		}
	}
	return "", p.syntax("unterminated string")
}

func (p *jsonParser) hex4() (rune, bool) {
	if p.pos+4 > len(p.in) {
		return 0, false
	}
	n, err := strconv.ParseUint(string(p.in[p.pos:p.pos+4]), 16, 32)
	if err != nil {
		return 0, false
	}
	p.pos += 4
	return rune(n), true
}

// number reads a number literal, checking JSON's grammar, and writes its
// canonical spelling.
func (p *jsonParser) number() error {
	start := p.pos
	if p.in[p.pos] == '-' {
		p.pos++
	}
	digits := func() int {
		n := 0
		for p.pos < len(p.in) && p.in[p.pos] >= '0' && p.in[p.pos] <= '9' {
			p.pos++
			n++
		}
		return n
	}
	switch {
	case p.pos < len(p.in) && p.in[p.pos] == '0':
		p.pos++
	case digits() == 0:
		return p.syntax("number without digits")
	}
	if p.pos < len(p.in) && p.in[p.pos] == '.' {
		p.pos++
		if digits() == 0 {
			return p.syntax("no digits after the decimal point")
		}
	}
	if p.pos < len(p.in) && (p.in[p.pos] == 'e' || p.in[p.pos] == 'E') {
		p.pos++
		if p.pos < len(p.in) && (p.in[p.pos] == '+' || p.in[p.pos] == '-') {
			p.pos++
		}
		if digits() == 0 {
			return p.syntax("no digits in the exponent")
		}
	}
	n, err := canonNumber(string(p.in[start:p.pos]))
	if err != nil {
		return err
	}
	p.out = append(p.out, n...)
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
		return "", fmt.Errorf("%w: JSON number %s is out of range", ErrNoCanonicalForm, s)
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
		return "", fmt.Errorf("%w: JSON number %s does not survive a float64 round trip (it would read as %s); send it as a string", ErrNoCanonicalForm, s, c)
	}
	return c, nil
}

func AppendString(out []byte, s string) []byte {
	out = append(out, '"')
	for _, r := range s {
		switch {
		case r == '"':
			out = append(out, '\\', '"')
		case r == '\\':
			out = append(out, '\\', '\\')
		case r == '\b':
			out = append(out, '\\', 'b')
		case r == '\f':
			out = append(out, '\\', 'f')
		case r == '\n':
			out = append(out, '\\', 'n')
		case r == '\r':
			out = append(out, '\\', 'r')
		case r == '\t':
			out = append(out, '\\', 't')
		case r < 0x20:
			out = fmt.Appendf(out, `\u%04x`, r)
		default:
			out = utf8.AppendRune(out, r)
		}
	}
	return append(out, '"')
}
