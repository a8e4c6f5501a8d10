package jobs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// A task's step waits in the process whose hub handed it out. Behind a
// load balancer a worker's report may reach another idem process: that
// process relays it through etcd. It writes the report as a value named
// for the task's hub (the task's id starts with the hub's), the hub that
// holds the task follows those values, answers each as if it had come
// itself (Report: its seq is checked, a repeat answered as before), and
// writes the answer as a value the relaying process waits for. A hub that
// is gone never answers: the relaying process answers ErrTaskGone after
// relayWait, and the step runs again elsewhere, as after a crash.

// relayWait bounds how long a relayed report waits for its answer.
const relayWait = 30 * time.Second

// relayed is a report on the wire between idem processes, and its answer.
type relayed struct {
	Report Report `json:"report"`
	Answer Answer `json:"answer"`
	Err    string `json:"err,omitempty"`  // the answer's error, as text
	Kind   string `json:"kind,omitempty"` // "gone" or "invalid": the error's kind
}

func newHubID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// hubOf returns the id of the hub that handed out task id ("" if none).
func hubOf(id string) string {
	h, _, ok := strings.Cut(id, "-")
	if !ok {
		return ""
	}
	return h
}

func (h *Hub) requestPrefix(hub string) string { return "tq/" + h.q.tenant + "/" + hub + "/" }
func (h *Hub) answerPrefix(hub string) string  { return "ta/" + h.q.tenant + "/" + hub + "/" }

// reportName names a relayed report: renewals are not numbered, so each
// has a name of its own.
func reportName(task string, rep Report) string {
	if rep.Op == "renew" {
		return task + "/renew-" + newTaskID()
	}
	return fmt.Sprintf("%s/%d", task, rep.Seq)
}

// relay sends rep for task id through etcd to the hub that holds it, and
// waits for its answer.
func (h *Hub) relay(ctx context.Context, id string, rep Report) (Answer, error) {
	hub := hubOf(id)
	if hub == "" || hub == h.id || h.q.store == nil {
		return Answer{}, fmt.Errorf("task %s: %w", id, ErrTaskGone)
	}
	b, err := json.Marshal(relayed{Report: rep})
	if err != nil {
		return Answer{}, err
	}
	name := reportName(id, rep)
	ctx, cancel := h.q.clock.WithTimeout(ctx, relayWait)
	defer cancel()
	// Follow the answer first, so that one written meanwhile is seen.
	feed, err := storex.Follow(h.q.store, ctx, h.q.tenant, storex.FollowOptions{ID: relayFollowID, Values: []string{h.answerPrefix(hub) + name}})
	if err != nil {
		return Answer{}, fmt.Errorf("report on task %s: %w", id, err)
	}
	defer feed.Close()
	// Written once: a copy of the report sent again finds it there, and
	// waits for the same answer.
	if _, _, err := storex.SetValue(h.q.store, ctx, h.requestPrefix(hub)+name, b, 0, storex.Retained()); err != nil && !errors.Is(err, etcdstore.ErrUnavailable) {
		return Answer{}, fmt.Errorf("report on task %s: %w", id, err)
	}
	for _, v := range feed.Values() {
		if v.Name == h.answerPrefix(hub)+name {
			return decodeRelayed(id, v.Value)
		}
	}
	for {
		changes, err := feed.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				// No answer: the hub is gone (or etcd did not carry it).
				// Its request goes too (best effort; else its retention).
				dctx, cancel := h.q.clock.WithTimeout(context.Background(), time.Second)
				if v, err := storex.GetValue(h.q.store, dctx, h.requestPrefix(hub)+name); err == nil && v.Revision != 0 {
					_, _ = storex.DeleteValue(h.q.store, dctx, v.Name, v.Revision)
				}
				cancel()
				return Answer{}, fmt.Errorf("task %s: %w: no answer from the idem process that holds it", id, ErrTaskGone)
			}
			return Answer{}, fmt.Errorf("report on task %s: %w", id, err)
		}
		for _, ch := range changes {
			if ch.Value != nil && ch.Value.Name == h.answerPrefix(hub)+name && ch.Value.Revision != 0 {
				return decodeRelayed(id, ch.Value.Value)
			}
		}
	}
}

// relayFollowID is the one key a relay's feed follows besides its values:
// none (a feed follows a tenant's records, or one).
const relayFollowID = "~relay"

func decodeRelayed(id string, b []byte) (Answer, error) {
	var r relayed
	if err := json.Unmarshal(b, &r); err != nil {
		return Answer{}, fmt.Errorf("report on task %s: an answer that cannot be read: %w", id, err)
	}
	switch r.Kind {
	case "gone":
		return Answer{}, fmt.Errorf("%w: %s", ErrTaskGone, r.Err)
	case "invalid":
		return Answer{}, fmt.Errorf("%w: %s", ErrInvalid, r.Err)
	case "":
		return r.Answer, nil
	}
	return Answer{}, errors.New(r.Err)
}

// serveRelays answers the reports other processes relay to this hub,
// until ctx ends (Close waits for the answers begun).
func (h *Hub) serveRelays(ctx context.Context) {
	for fails := 0; ctx.Err() == nil; fails++ {
		feed, err := storex.Follow(h.q.store, ctx, h.q.tenant, storex.FollowOptions{ID: relayFollowID, Values: []string{h.requestPrefix(h.id)}})
		if err == nil {
			fails = 0
			for _, v := range feed.Values() {
				h.answering.Add(1)
				go h.answerRelayed(ctx, v)
			}
			for err == nil {
				var changes []storex.Change
				changes, err = feed.Next(ctx)
				for _, ch := range changes {
					if ch.Value != nil && ch.Value.Revision != 0 {
						h.answering.Add(1)
						go h.answerRelayed(ctx, *ch.Value)
					}
				}
			}
			feed.Close()
		}
		if ctx.Err() != nil {
			return
		}
		h.q.log.Info("idem: a hub re-reading relayed reports", "err", err)
		clock.Sleep(h.q.clock, ctx, min(time.Duration(100<<min(fails, 6))*time.Millisecond, 5*time.Second))
	}
}

// answerRelayed answers relayed report v and removes it.
func (h *Hub) answerRelayed(ctx context.Context, v storex.Value) {
	name := strings.TrimPrefix(v.Name, h.requestPrefix(h.id))
	task, _, _ := strings.Cut(name, "/")
	var r relayed
	defer h.answering.Done()
	if err := json.Unmarshal(v.Value, &r); err != nil {
		r.Kind, r.Err = "invalid", "a relayed report that cannot be read: "+err.Error()
	} else {
		a, err := h.Report(ctx, task, r.Report)
		r.Answer = a
		switch {
		case errors.Is(err, ErrTaskGone):
			r.Kind, r.Err = "gone", err.Error()
		case errors.Is(err, ErrInvalid):
			r.Kind, r.Err = "invalid", err.Error()
		case err != nil:
			if ctx.Err() != nil {
				return // closing: the relaying process answers gone
			}
			r.Kind, r.Err = "error", err.Error()
		}
	}
	b, err := json.Marshal(r)
	if err != nil {
		return
	}
	// The request goes first: a relaying process whose copy of it found
	// this one there (and so wrote none) follows the answer from before,
	// and the answer is written after, so it sees it; deleted after the
	// answer, such a copy could wait for an answer nobody writes (found by
	// TestAReportThatReachesAnotherProcessIsRelayed under -race -count=8).
	// The answer is on this process's session, and deleted once written:
	// a report sent again gets the same answer again (Report keeps answers
	// by seq).
	dctx := context.WithoutCancel(ctx)
	_, _ = storex.DeleteValue(h.q.store, dctx, v.Name, v.Revision)
	// (Not ctx: Close ends it once the steps drained, and waits for the
	// answers begun; an answer must not be lost to it.)
	av, ok, err := storex.SetValue(h.q.store, dctx, h.answerPrefix(h.id)+name, b, 0, storex.OnSession())
	if err == nil && !ok {
		// An answer left there (its delete failed): written over.
		av, ok, err = storex.SetValue(h.q.store, dctx, h.answerPrefix(h.id)+name, b, av.Revision, storex.OnSession())
	}
	if err == nil && ok {
		_, _ = storex.DeleteValue(h.q.store, dctx, av.Name, av.Revision)
	}
}
