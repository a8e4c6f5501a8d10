package cluster_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdtest"
)

var soak = flag.Bool("soak", os.Getenv("IDEM_SOAK") == "1", "run the fault scenarios for longer (also IDEM_SOAK=1)")

// faultTime is how long each fault is held (and how often it repeats).
func faultTime() time.Duration {
	if *soak {
		return 20 * time.Second
	}
	return 2 * time.Second
}

// scenario is one fault, applied while clients run, healed, then proven.
type scenario struct {
	members int
	pins    []int // the client processes: member index of each, -1 for all members
	// fault applies the fault (and heals what it must to finish, e.g.
	// restarts); the runner heals every proxy and cut link after it.
	fault func(ctx context.Context, e *env) error
	// fired reports whether the fault fired, after the run: if not, the
	// scenario proved nothing and fails as invalid.
	fired func(e *env) error
}

func run(t *testing.T, sc scenario) {
	if testing.Short() {
		t.Skip("fault scenarios skipped in -short mode")
	}
	start := time.Now()
	e := newEnv(t, sc.members, etcdtest.Options{})
	for _, p := range sc.pins {
		e.newClient(p)
	}
	stop := make(chan struct{})
	loaded := make(chan []string, 1)
	go func() { loaded <- e.load(stop, 4) }()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	time.Sleep(300 * time.Millisecond) // load before the fault, so the fault hits work in progress
	e.faultOn.Store(true)
	faultErr := sc.fault(ctx, e)
	e.faultOn.Store(false)
	e.cluster.Heal()
	if _, err := e.cluster.WaitLeader(ctx, runningMembers(e)); err != nil {
		t.Fatalf("no leader after healing: %v", err)
	}
	time.Sleep(300 * time.Millisecond) // load after healing too
	close(stop)
	orders := append(<-loaded, e.extra...)
	if faultErr != nil {
		t.Fatalf("applying the fault: %v", faultErr)
	}
	e.closeClients()
	final := e.settle(orders)
	e.checkInvariants(orders, final)
	if err := sc.fired(e); err != nil {
		t.Fatalf("INVALID: the fault did not fire: %v", err)
	}
	t.Logf("takeovers %d, stale writes refused %d, in %v", e.totalTakeovers(), staleRefused(e), time.Since(start).Round(time.Millisecond))
}

func staleRefused(e *env) int {
	_, stale := e.sink.snapshot()
	return stale
}

func runningMembers(e *env) []int {
	var idx []int
	for i, m := range e.cluster.Members {
		if m.Etcd() != nil {
			idx = append(idx, i)
		}
	}
	return idx
}

func others(n, except int) []int {
	var idx []int
	for i := 0; i < n; i++ {
		if i != except {
			idx = append(idx, i)
		}
	}
	return idx
}

// The leader is killed (a hard stop, as a crash) and restarted, repeatedly.
func TestLeaderKilledRepeatedly(t *testing.T) {
	var leaders []int
	run(t, scenario{
		members: 3,
		pins:    []int{0, 1, 2, -1},
		fault: func(ctx context.Context, e *env) error {
			kills := 3
			if *soak {
				kills = 10
			}
			for k := 0; k < kills; k++ {
				l, err := e.cluster.WaitLeader(ctx, e.cluster.All())
				if err != nil {
					return err
				}
				leaders = append(leaders, l)
				e.cluster.Members[l].Kill()
				if _, err := e.cluster.WaitLeader(ctx, others(3, l), l); err != nil {
					return err
				}
				time.Sleep(faultTime() / 4) // traffic while the old leader is down
				if err := e.cluster.Members[l].Restart(ctx); err != nil {
					return fmt.Errorf("restart %d: %w", l, err)
				}
			}
			return nil
		},
		fired: func(e *env) error {
			if len(leaders) < 3 {
				return fmt.Errorf("only %d leaders killed", len(leaders))
			}
			if e.faultOps.Load() == 0 {
				return fmt.Errorf("no client operation failed while leaders were killed")
			}
			return nil
		},
	})
}

// A follower is cut off; clients pinned to it keep trying. A claim it held
// in flight is taken over once its session expires, and its late write is
// refused.
func TestMinorityPartition(t *testing.T) {
	var isolated = -1
	var during int64
	run(t, scenario{
		members: 3,
		pins:    []int{0, 1, 2, 0, 1, 2, -1},
		fault: func(ctx context.Context, e *env) error {
			l, err := e.cluster.WaitLeader(ctx, e.cluster.All())
			if err != nil {
				return err
			}
			isolated = (l + 1) % 3
			release := e.holdClaim(e.clients[isolated], "held-in-minority")
			if err := e.cluster.Isolate(isolated); err != nil {
				return err
			}
			if err := e.cluster.WaitIsolated(ctx, isolated); err != nil {
				return err
			}
			before := e.fresh.Load()
			time.Sleep(faultTime())
			if err := e.takeOver("held-in-minority"); err != nil {
				return err
			}
			during = e.fresh.Load() - before
			e.cluster.Heal()
			release()
			return nil
		},
		fired: func(e *env) error {
			// The isolated member lost its leader (WaitIsolated, in the fault).
			var pinnedFailures int64
			for _, c := range e.clients {
				if c.pinned == isolated {
					pinnedFailures += c.failures.Load()
				}
			}
			switch {
			case pinnedFailures == 0:
				return fmt.Errorf("clients pinned to the isolated member never failed")
			case during == 0:
				return fmt.Errorf("the majority made no progress during the partition")
			case e.totalTakeovers() == 0:
				return fmt.Errorf("the claim held in the minority was not taken over")
			case staleRefused(e) == 0:
				return fmt.Errorf("the minority's late write was not refused")
			}
			return nil
		},
	})
}

// The leader is isolated in the minority; the majority elects another. A
// claim made through the old leader is taken over; its late write refused.
func TestLeaderIsolated(t *testing.T) {
	oldLeader, newLeader := -1, -1
	run(t, scenario{
		members: 3,
		pins:    []int{0, 1, 2, -1},
		fault: func(ctx context.Context, e *env) error {
			var err error
			if oldLeader, err = e.cluster.WaitLeader(ctx, e.cluster.All()); err != nil {
				return err
			}
			release := e.holdClaim(e.clients[oldLeader], "held-by-old-leader")
			if err := e.cluster.Isolate(oldLeader); err != nil {
				return err
			}
			if err := e.cluster.WaitIsolated(ctx, oldLeader); err != nil {
				return err // it stepped down: no quorum behind it
			}
			if newLeader, err = e.cluster.WaitLeader(ctx, others(3, oldLeader), oldLeader); err != nil {
				return err
			}
			time.Sleep(faultTime())
			if err := e.takeOver("held-by-old-leader"); err != nil {
				return err
			}
			e.cluster.Heal()
			release()
			return nil
		},
		fired: func(e *env) error {
			switch {
			case newLeader < 0 || newLeader == oldLeader:
				return fmt.Errorf("leader did not change: %d -> %d", oldLeader, newLeader)
			case e.totalTakeovers() == 0:
				return fmt.Errorf("the claim held through the old leader was not taken over")
			case staleRefused(e) == 0:
				return fmt.Errorf("the old side's late write was not refused")
			}
			return nil
		},
	})
}

// Clients' links to etcd are blackholed, then slow.
func TestClientLinkBlackholedAndDelayed(t *testing.T) {
	run(t, scenario{
		members: 3,
		pins:    []int{0, 0, 1, 2},
		fault: func(ctx context.Context, e *env) error {
			p := e.cluster.Members[0].ClientProxy
			p.Blackhole()
			time.Sleep(faultTime())
			p.Heal()
			p.Delay(100*time.Millisecond, 50*time.Millisecond)
			time.Sleep(faultTime())
			return nil
		},
		fired: func(e *env) error {
			p := e.cluster.Members[0].ClientProxy
			if p.Dropped.Load() == 0 {
				return fmt.Errorf("the client link dropped nothing")
			}
			if e.clients[0].failures.Load()+e.clients[1].failures.Load() == 0 {
				return fmt.Errorf("the cut-off clients never failed")
			}
			return nil
		},
	})
}

// Members are 50 ms apart (a WAN between data centres), with latency spikes
// standing in for packet loss (TCP turns loss into retransmission delay).
func TestWANLatencyAndLoss(t *testing.T) {
	var lat []time.Duration
	run(t, scenario{
		members: 3,
		pins:    []int{0, 1, 2, -1},
		fault: func(ctx context.Context, e *env) error {
			for _, m := range e.cluster.Members {
				m.PeerProxy.Delay(25*time.Millisecond, 5*time.Millisecond) // ~50 ms RTT
			}
			end := time.Now().Add(2 * faultTime())
			for i := 0; time.Now().Before(end); i++ {
				// Measure one claim's round: a raft write across the WAN.
				c := e.clients[3]
				probe := fmt.Sprintf("wan-probe-%d", i)
				e.mu.Lock()
				e.extra = append(e.extra, probe)
				e.mu.Unlock()
				t0 := time.Now()
				if e.attempt(c, probe, attemptTimeout) {
					lat = append(lat, time.Since(t0))
				}
				spike := e.cluster.Members[i%3].PeerProxy
				spike.Delay(25*time.Millisecond, 200*time.Millisecond) // a burst of "loss"
				time.Sleep(100 * time.Millisecond)
				spike.Delay(25*time.Millisecond, 5*time.Millisecond)
			}
			return nil
		},
		fired: func(e *env) error {
			if len(lat) == 0 {
				return fmt.Errorf("no probe succeeded")
			}
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			med := lat[len(lat)/2]
			e.t.Logf("WAN probe (claim + work + complete) median %v over %d probes", med, len(lat))
			if med < 50*time.Millisecond {
				return fmt.Errorf("median Do %v is under one 50 ms round trip: the delay did not apply", med)
			}
			return nil
		},
	})
}

// A follower stops and restarts on its data directory.
func TestMemberRestart(t *testing.T) {
	restarted := -1
	run(t, scenario{
		members: 3,
		pins:    []int{0, 1, 2, -1},
		fault: func(ctx context.Context, e *env) error {
			l, err := e.cluster.WaitLeader(ctx, e.cluster.All())
			if err != nil {
				return err
			}
			restarted = (l + 2) % 3
			e.cluster.Members[restarted].Stop()
			time.Sleep(faultTime())
			return e.cluster.Members[restarted].Restart(ctx)
		},
		fired: func(e *env) error {
			m := e.cluster.Members[restarted]
			if m.Etcd() == nil {
				return fmt.Errorf("member %d is not running", restarted)
			}
			// It caught up: it serves a linearizable read of the final state.
			cli := e.cluster.MustClient(e.t, m.ClientURL)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp, err := cli.Get(ctx, e.prefix, withPrefixCount()...)
			if err != nil || resp.Count == 0 {
				return fmt.Errorf("restarted member serves %v records, %v", resp, err)
			}
			return nil
		},
	})
}

// Five members; two are cut off together.
func TestFiveMembersTwoPartitioned(t *testing.T) {
	cut := []int{}
	isolatedBoth := false
	var during int64
	run(t, scenario{
		members: 5,
		pins:    []int{0, 1, 2, 3, 4},
		fault: func(ctx context.Context, e *env) error {
			l, err := e.cluster.WaitLeader(ctx, e.cluster.All())
			if err != nil {
				return err
			}
			cut = []int{(l + 1) % 5, (l + 2) % 5}
			for _, i := range cut {
				if err := e.cluster.Isolate(i); err != nil {
					return err
				}
			}
			for _, i := range cut {
				if err := e.cluster.WaitIsolated(ctx, i); err != nil {
					return err
				}
			}
			isolatedBoth = true
			before := e.fresh.Load()
			time.Sleep(faultTime())
			during = e.fresh.Load() - before
			return nil
		},
		fired: func(e *env) error {
			if !isolatedBoth {
				return fmt.Errorf("the two members were not cut off")
			}
			if during == 0 {
				return fmt.Errorf("the three-member majority made no progress")
			}
			return nil
		},
	})
}
