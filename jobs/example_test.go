package jobs_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

// endpoints returns the test cluster's endpoints (set by TestMain); in your
// code, your etcd cluster's.
func endpoints() []string { return strings.Split(os.Getenv("IDEM_TEST_ETCD_ENDPOINTS"), ",") }

func ExampleWorker() {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix("/example/"+uuid.NewString()+"/"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		log.Fatal(err)
	}

	// A kind is named steps; each one finished is a recovery point.
	refund := jobs.Kind{Name: "refund", Steps: []jobs.Step{
		{Name: "reverse", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			fmt.Println("reversing the charge, idempotency key", r.StepKey())
			return []byte(`"re_1"`), nil
		}},
		{Name: "notify", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			fmt.Printf("telling the customer about %s\n", r.Output("reverse"))
			return nil, nil
		}},
	}}
	w, err := jobs.NewWorker(q, []jobs.Kind{refund}) // its completer runs waiting jobs
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()

	// Submitted twice (a retried request, a redelivered message): one job.
	for range 2 {
		if _, err := q.Submit(ctx, "refund-order-42", "refund", []byte(`{"order":42}`)); err != nil {
			log.Fatal(err)
		}
	}
	j, err := q.Wait(ctx, "refund-order-42")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(j.State, "after", j.Attempts, "attempt")
	// Output:
	// reversing the charge, idempotency key jobs:refund-order-42.reverse
	// telling the customer about "re_1"
	// succeeded after 1 attempt
}

// The worker of docs/JOBS.md's "Your first job": it runs the "welcome"
// jobs that idem jobs submit puts in the store of idem serve's embedded
// etcd (endpoints() is []string{"unix://idem-data/etcd.sock"} there).
func Example_firstJob() {
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli) // idem serve's defaults: prefix /idem/, 24 h retention
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store) // tenant "jobs", as idem jobs uses
	if err != nil {
		log.Fatal(err)
	}
	welcome := jobs.Kind{Name: "welcome", Steps: []jobs.Step{
		{Name: "greet", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			fmt.Printf("hello, %s\n", r.Params())
			return []byte(`"greeted"`), nil
		}},
	}}
	w, err := jobs.NewWorker(q, []jobs.Kind{welcome})
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	if _, err := q.Submit(ctx, "welcome-ada", "welcome", []byte(`"Ada"`)); err != nil { // or: idem jobs submit
		log.Fatal(err)
	}
	j, err := q.Wait(ctx, "welcome-ada")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(j.State)
	// Output:
	// hello, "Ada"
	// succeeded
}

// The monthly invoice run of docs/JOBS.md: the same program runs in each
// data centre. Each process schedules the run and works on jobs; the run
// fans out one job per account.
func Example_invoiceRun() {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	// A month of jobs must be remembered for longer than a day.
	store, err := etcdstore.New(ctx, cli, etcdstore.WithRetention(45*24*time.Hour))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store, jobs.WithTenant("billing"))
	if err != nil {
		log.Fatal(err)
	}

	run := jobs.Kind{Name: "invoice-run", Steps: []jobs.Step{
		{Name: "select-accounts", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			return json.Marshal(accountsToBill(ctx, r.Params())) // saved: never selected twice
		}},
		{Name: "fan-out", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			var accounts []string
			json.Unmarshal(r.Output("select-accounts"), &accounts)
			for _, a := range accounts { // a retried fan-out submits the same jobs: nothing twice
				id := "invoice:" + a + ":" + string(r.Params())
				if _, err := q.Submit(ctx, id, "invoice", []byte(`"`+a+`"`)); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}},
	}}
	invoice := jobs.Kind{Name: "invoice", MaxAttempts: 8, Steps: []jobs.Step{
		{Name: "charge", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			// The provider deduplicates by the step key and refuses a
			// token lower than the highest it has seen.
			req, _ := http.NewRequestWithContext(ctx, "POST", "https://payments.example/charges", nil)
			req.Header.Set("Idempotency-Key", r.StepKey())
			fencing.SetHeader(req.Header, r.Token())
			return nil, chargeAccount(req)
		}},
		{Name: "record", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			r.Commit(clientv3.OpPut("/ledger/"+r.Key().ID, "charged")) // exactly once, with the checkpoint
			return nil, nil
		}},
		{Name: "email", OnError: jobs.Retry, Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			return nil, sendInvoiceEmail(ctx, r.StepKey(), r.Params())
		}},
	}}
	w, err := jobs.NewWorker(q, []jobs.Kind{run, invoice}, jobs.Concurrency(16))
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	paris, _ := time.LoadLocation("Europe/Paris")
	s, err := jobs.NewScheduler(q, []jobs.Schedule{{
		Name: "monthly-invoices", Cron: "0 3 1 * *", Location: paris, Kind: "invoice-run",
		CatchUp: jobs.CatchUpAll, // a month missed while every data centre was down still runs
		Params:  func(t time.Time) []byte { return []byte(t.AddDate(0, -1, 0).Format("2006-01")) },
	}})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	<-ctx.Done() // serve until told to stop
}

func accountsToBill(ctx context.Context, month []byte) []string           { return nil }
func chargeAccount(req *http.Request) error                               { return nil }
func sendInvoiceEmail(ctx context.Context, key string, acct []byte) error { return nil }

// A refund that waits for a manager's approval (an event, signalled by
// another service, or twice: it is delivered once), then a cooling-off
// period (a durable sleep), then pays. No worker holds the job while it
// waits or sleeps; a worker that dies meanwhile changes nothing.
func Example_approval() {
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix("/idem-example-approval/"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		log.Fatal(err)
	}
	refund := jobs.Kind{Name: "refund", Steps: []jobs.Step{
		// The payload is this step's output; no approval in 8 h fails the job
		// (a wait is at most half the store's retention, 24 h by default).
		jobs.AwaitStep("approval", "approved", 8*time.Hour, jobs.Fail),
		jobs.SleepStep("cool-off", time.Second), // a day, in production
		{Name: "pay", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			fmt.Printf("paying %s, approved by %s\n", r.Params(), r.Output("approval"))
			return nil, nil
		}},
	}}
	w, err := jobs.NewWorker(q, []jobs.Kind{refund})
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	if _, err := q.Submit(ctx, "refund-81", "refund", []byte(`"42 EUR"`)); err != nil { // or POST /v1/jobs
		log.Fatal(err)
	}
	for range 2 { // a retried signal: or idem jobs signal, or POST /v1/jobs/refund-81/signals/approved
		if err := q.Signal(ctx, "refund-81", "approved", []byte(`"ada"`)); err != nil {
			log.Fatal(err)
		}
	}
	j, err := q.Wait(ctx, "refund-81")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(j.State, j.Attempts)
	// Output:
	// paying "42 EUR", approved by "ada"
	// succeeded 1
}

// Example_merchantLimit runs payouts at most one at a time per merchant,
// and at most five a second, across every worker of every data centre:
// a merchant's second payout waits for the first's slot.
func Example_merchantLimit() {
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix("/idem-example-limit/"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		log.Fatal(err)
	}
	var mu sync.Mutex
	running := map[string]int{} // payouts of each merchant running now
	payout := jobs.Kind{Name: "payout",
		Limits: []jobs.Limit{{Name: "merchant", Key: jobs.ParamKey("merchant"), Concurrency: 1, Rate: 5}},
		Steps: []jobs.Step{{Name: "pay", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			m, _ := jobs.ParamKey("merchant")(r.Params())
			mu.Lock()
			running[m]++
			if running[m] > 1 {
				fmt.Println("two payouts of", m, "at once")
			}
			mu.Unlock()
			defer func() { mu.Lock(); running[m]--; mu.Unlock() }()
			return nil, nil
		}}}}
	w, err := jobs.NewWorker(q, []jobs.Kind{payout}, jobs.Concurrency(8))
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	for i := range 6 {
		params := fmt.Sprintf(`{"merchant":"m%d","amount":%d}`, i%2, 10*i)
		if _, err := q.Submit(ctx, fmt.Sprintf("payout-%d", i), "payout", []byte(params)); err != nil {
			log.Fatal(err)
		}
	}
	for i := range 6 {
		j, err := q.Wait(ctx, fmt.Sprintf("payout-%d", i))
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(j.Key.ID, j.State)
	}
	// Output:
	// payout-0 succeeded
	// payout-1 succeeded
	// payout-2 succeeded
	// payout-3 succeeded
	// payout-4 succeeded
	// payout-5 succeeded
}

// Example_zone submits a job in a data centre's zone: its workers there
// are preferred (each job by one of them), and the workers of other
// zones take it only when none of the zone's has, FallbackAfter later.
func Example_zone() {
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix("/idem-example-zone/"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store, jobs.WithZone("eu-west-1")) // or idem serve --zone, idem jobs submit --zone
	if err != nil {
		log.Fatal(err)
	}
	report := jobs.Kind{Name: "report", Steps: []jobs.Step{{Name: "build", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
		return []byte(`"built in ` + q.Zone() + `"`), nil
	}}}}
	w, err := jobs.NewWorker(q, []jobs.Kind{report}, jobs.FallbackAfter(2*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	if _, err := q.Submit(ctx, "report-2026-12", "report", nil); err != nil {
		log.Fatal(err)
	}
	j, err := q.Wait(ctx, "report-2026-12")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(j.State, j.Zone, string(j.Output("build")))
	// Output:
	// succeeded eu-west-1 "built in eu-west-1"
}

func Example_shardSet() {
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	// Two etcd clusters (here two prefixes of one): each job is kept on
	// the shard its id is placed on, as package shard places keys.
	var cfg shard.Config
	for _, name := range []string{"eu", "us"} {
		cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
		if err != nil {
			log.Fatal(err)
		}
		defer cli.Close()
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: name, Client: cli,
			Options: []etcdstore.Option{etcdstore.WithPrefix("/idem-example-shards/" + name + "/")}})
	}
	set, err := shard.New(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer set.Close()
	q, err := jobs.NewOnShards(set)
	if err != nil {
		log.Fatal(err)
	}
	report := jobs.Kind{Name: "report", Steps: []jobs.Step{{Name: "build", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
		return []byte(`"built"`), nil
	}}}}
	w, err := jobs.NewWorker(q, []jobs.Kind{report}) // a completer per shard
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	for _, id := range []string{"report-acme", "report-globex", "report-initech"} {
		if _, err := q.Submit(ctx, id, "report", nil); err != nil {
			log.Fatal(err)
		}
		j, err := q.Wait(ctx, id)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(id, j.State, "on shard", set.Place(j.Key))
	}
	// Output:
	// report-acme succeeded on shard eu
	// report-globex succeeded on shard eu
	// report-initech succeeded on shard us
}
