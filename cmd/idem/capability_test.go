package main

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// An attacker inside the victim's tenant, against idem serve's worker API:
// it knows the victim's key, reads its token and fingerprint, claims a
// probe key of its own to learn how attempt ids look, and forges handles
// for the victim's claim. None completes or abandons it; the victim's own
// handle still does. A worker-chosen attempt id too short to be a secret
// is refused.
func TestHandlesAreCapabilities(t *testing.T) {
	dir := tempDir(t)
	idem := startIdem(t, dir, embeddedFlags(t, filepath.Join(dir, "data"))...)
	type handle struct {
		Key      string `json:"key"`
		Attempt  string `json:"attempt"`
		Token    int64  `json:"token"`
		Revision int64  `json:"revision"`
	}
	claim := func(body string) (int, handle) {
		t.Helper()
		r := send(t, "POST", idem.listen+"/v1/claim", "", body)
		var c struct{ Handle handle }
		if r.status == 201 {
			if err := json.Unmarshal([]byte(r.body), &c); err != nil {
				t.Fatalf("claim %s: %q: %v", body, r.body, err)
			}
		}
		return r.status, c.Handle
	}
	st, victim := claim(`{"key":"victim-charge","params":{"amount":100}}`)
	if st != 201 {
		t.Fatalf("victim's claim = %d", st)
	}
	_, probe := claim(`{"key":"attacker-probe","params":{}}`)

	// What anyone in the tenant can read: no attempt id.
	r := send(t, "GET", idem.listen+"/v1/keys/victim-charge", "", "")
	var view map[string]any
	if r.status != 200 || json.Unmarshal([]byte(r.body), &view) != nil || int64(view["token"].(float64)) != victim.Token {
		t.Fatalf("GET the victim's key = %d %q", r.status, r.body)
	}
	if strings.Contains(r.body, victim.Attempt) || strings.Contains(r.body, `"attempt"`) {
		t.Fatalf("GET /v1/keys shows the claim's attempt id: %s", r.body)
	}
	if len(victim.Attempt) < 22 || victim.Attempt == probe.Attempt {
		t.Fatalf("attempt ids %q and %q: want random ones of 128 bits or more", victim.Attempt, probe.Attempt)
	}

	// Forged handles: the probe's attempt, its neighbours if it is a
	// prefix and a counter, and the victim's attempt without its last
	// character.
	guesses := []string{probe.Attempt, victim.Attempt[:len(victim.Attempt)-1]}
	if i := strings.LastIndexByte(probe.Attempt, '-'); i > 0 {
		if n, err := strconv.ParseInt(probe.Attempt[i+1:], 36, 64); err == nil {
			for _, d := range []int64{-2, -1, 1} {
				guesses = append(guesses, probe.Attempt[:i+1]+strconv.FormatInt(n+d, 36))
			}
		}
	}
	for _, g := range guesses {
		forged := fmt.Sprintf(`{"key":"victim-charge","attempt":%q,"token":%d,"revision":%d}`, g, victim.Token, victim.Token)
		if r := send(t, "POST", idem.listen+"/v1/complete", "", `{"handle":`+forged+`,"outcome":{"body":"ZmFrZQ=="}}`); r.status != 409 {
			t.Fatalf("complete with a forged handle (attempt %q) = %d %q; want 409 fenced", g, r.status, r.body)
		}
		if r := send(t, "POST", idem.listen+"/v1/abandon", "", `{"handle":`+forged+`}`); r.status != 409 {
			t.Fatalf("abandon with a forged handle (attempt %q) = %d %q; want 409 fenced", g, r.status, r.body)
		}
		// Claiming with a guessed attempt is not recognised as the owner.
		if st, _ := claim(fmt.Sprintf(`{"key":"victim-charge","params":{"amount":100},"attempt":%q}`, g+strings.Repeat("x", 22))); st != 409 {
			t.Fatalf("claim with a guessed attempt = %d; want 409 conflict", st)
		}
	}
	h, _ := json.Marshal(victim)
	if r := send(t, "POST", idem.listen+"/v1/complete", "", `{"handle":`+string(h)+`,"outcome":{"body":"b2s="}}`); r.status != 200 {
		t.Fatalf("the victim's own complete = %d %q", r.status, r.body)
	}
	if r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"victim-charge","params":{"amount":100}}`); r.status != 200 || !strings.Contains(r.body, `"body":"b2s="`) {
		t.Fatalf("replay of the victim's key = %d %q; want the victim's outcome", r.status, r.body)
	}

	// A worker's own attempt id must be long enough to be a secret.
	if r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"short","params":{},"attempt":"a3-api"}`); r.status != 400 || !strings.Contains(r.body, "at least 22") {
		t.Fatalf("claim with a 6-character attempt = %d %q; want 400", r.status, r.body)
	}
	uuid := "0f8b9a4e-3c2d-4b1a-9e8f-7d6c5b4a3928"
	if st, h := claim(`{"key":"long","params":{},"attempt":"` + uuid + `"}`); st != 201 || h.Attempt != uuid {
		t.Fatalf("claim with a UUID attempt = %d %+v", st, h)
	}
}
