package fencing

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		in   string
		want Token
		ok   bool
	}{
		{"1", 1, true},
		{"9223372036854775807", 9223372036854775807, true},
		{"", 0, false},
		{"0", 0, false},
		{"-1", 0, false},
		{"+1", 0, false},
		{"01", 0, false},
		{" 1", 0, false},
		{"1.0", 0, false},
		{"9223372036854775808", 0, false},
		{"0x10", 0, false},
	}
	for _, tt := range tests {
		got, err := Parse(tt.in)
		if tt.ok != (err == nil) || got != tt.want {
			t.Errorf("Parse(%q) = %d, %v; want %d, ok=%v", tt.in, got, err, tt.want, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalidToken) {
			t.Errorf("Parse(%q) error %v does not wrap ErrInvalidToken", tt.in, err)
		}
	}
}

func TestHeaderRoundTrip(t *testing.T) {
	h := http.Header{}
	if _, ok, err := FromHeader(h); ok || err != nil {
		t.Fatalf("FromHeader(empty) = ok %v, err %v; want false, nil", ok, err)
	}
	h.Set(Header, "999") // a client-supplied value must be replaced
	SetHeader(h, 42)
	got, ok, err := FromHeader(h)
	if err != nil || !ok || got != 42 {
		t.Fatalf("FromHeader = %d, %v, %v; want 42, true, nil", got, ok, err)
	}
	h.Add(Header, "43")
	if _, _, err := FromHeader(h); !errors.Is(err, ErrInvalidToken) {
		t.Fatalf("FromHeader(repeated) err = %v; want ErrInvalidToken", err)
	}
}

func TestContext(t *testing.T) {
	if _, ok := FromContext(context.Background()); ok {
		t.Fatal("FromContext(empty) reported a token")
	}
	ctx := NewContext(context.Background(), 7)
	if got, ok := FromContext(ctx); !ok || got != 7 {
		t.Fatalf("FromContext = %d, %v; want 7, true", got, ok)
	}
}

func TestCheckerRefusesLowerTokens(t *testing.T) {
	var c Checker
	steps := []struct {
		token   Token
		stale   bool
		highest Token // after the step
	}{
		{10, false, 10},
		{10, false, 10}, // the same owner writing again
		{9, true, 10},
		{11, false, 11},
		{10, true, 11},
	}
	for i, s := range steps {
		err := c.Check("order-1", s.token)
		if s.stale != errors.Is(err, ErrStale) {
			t.Fatalf("step %d: Check(%d) = %v; want stale=%v", i, s.token, err, s.stale)
		}
		var se *StaleError
		if s.stale && (!errors.As(err, &se) || se.Highest != s.highest || se.Token != s.token) {
			t.Fatalf("step %d: error %v is not a *StaleError naming token %d and highest %d", i, err, s.token, s.highest)
		}
		if got := c.Highest("order-1"); got != s.highest {
			t.Fatalf("step %d: Highest = %d; want %d", i, got, s.highest)
		}
	}
	if got := c.Highest("order-1"); got != 11 {
		t.Fatalf("Highest = %d; want 11", got)
	}
	if err := c.Check("order-2", 1); err != nil {
		t.Fatalf("a different resource is independent: %v", err)
	}
	if err := c.Check("order-2", 0); !errors.Is(err, ErrInvalidToken) {
		t.Fatalf("Check(0) = %v; want ErrInvalidToken", err)
	}
	c.Forget("order-1")
	if err := c.Check("order-1", 1); err != nil {
		t.Fatalf("after Forget, Check(1) = %v", err)
	}
}

func TestCheckerConcurrentHighestWins(t *testing.T) {
	var c Checker
	var wg sync.WaitGroup
	for i := 1; i <= 100; i++ {
		wg.Add(1)
		go func(tok Token) {
			defer wg.Done()
			_ = c.Check("r", tok)
		}(Token(i))
	}
	wg.Wait()
	if got := c.Highest("r"); got != 100 {
		t.Fatalf("Highest = %d; want 100", got)
	}
	if err := c.Check("r", 99); !errors.Is(err, ErrStale) {
		t.Fatalf("Check(99) after 100 = %v; want ErrStale", err)
	}
}
