package etcdstore_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"github.com/google/uuid"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
)

// endpoints returns the test cluster's endpoints (set by TestMain); in your
// code, your etcd cluster's.
func endpoints() []string { return strings.Split(os.Getenv("IDEM_TEST_ETCD_ENDPOINTS"), ",") }

func ExampleStore_Do() {
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

	// The client generated this key once, when the user pressed "Pay", and
	// sends it with every retry.
	key := etcdstore.Key{Tenant: "acme", ID: "9b2f6c1e-charge-order-42"}
	charge := func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
		fmt.Println("charging the card")
		return []byte(`{"charge":"ch_1","amount":100}`), nil
	}
	for try := 1; try <= 3; try++ {
		res, err := store.Do(ctx, key, []byte(`{"order":42,"amount":100}`), charge)
		fmt.Printf("try %d: %s replayed=%v err=%v\n", try, res.Body, res.Replayed, err)
	}
	// The same key with other parameters is a client bug.
	_, err = store.Do(ctx, key, []byte(`{"order":42,"amount":999}`), charge)
	fmt.Println("mismatch:", errors.Is(err, etcdstore.ErrMismatch))
	// Output:
	// charging the card
	// try 1: {"charge":"ch_1","amount":100} replayed=false err=<nil>
	// try 2: {"charge":"ch_1","amount":100} replayed=true err=<nil>
	// try 3: {"charge":"ch_1","amount":100} replayed=true err=<nil>
	// mismatch: true
}

// A job runner that holds the steps itself: claim, checkpoint between steps,
// and complete in the same Txn as an effect that lives in etcd.
func ExampleStore_Claim() {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints(), Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	defer cli.Close()
	run := uuid.NewString()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix("/example/"+run+"/"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	key := etcdstore.Key{Tenant: "billing", ID: "invoice-2026-11"}
	fp, _ := etcdstore.FingerprintOf([]byte(`{"month":"2026-11"}`))
	claim, done, err := store.Claim(ctx, key, fp, etcdstore.WithDeadline(10*time.Minute))
	switch {
	case err != nil:
		log.Fatal(err) // *ConflictError: retry later; *MismatchError: a bug
	case done != nil:
		fmt.Printf("already done: %s\n", done.Outcome.Body)
		return
	}
	if claim.TookOver() {
		fmt.Printf("resuming from %s\n", claim.LastCheckpoint())
	}
	// Step 1, then a recovery point.
	if err := claim.Checkpoint(ctx, []byte("pdf rendered")); err != nil {
		log.Fatal(err) // ErrFenced: someone else owns the job now
	}
	// Step 2 lives in etcd: it commits with the outcome, exactly once.
	// (Extra ops must stay outside the store's prefix.)
	ledger := clientv3.OpPut("/ledger/"+run+"/invoice-2026-11", "sent")
	if err := claim.Complete(ctx, etcdstore.Outcome{Body: []byte("sent")}, ledger); err != nil {
		log.Fatal(err)
	}
	fmt.Println("token > 0:", claim.Token() > 0)

	_, done, _ = store.Claim(ctx, key, fp)
	fmt.Printf("a retry replays: %s\n", done.Outcome.Body)
	// Output:
	// token > 0: true
	// a retry replays: sent
}

func ExampleFingerprintOf() {
	a, _ := etcdstore.FingerprintOf([]byte(`{"amount": 100, "currency": "eur"}`))
	b, _ := etcdstore.FingerprintOf([]byte(`{"currency":"eur","amount":100.0}`))
	c, _ := etcdstore.FingerprintOf([]byte(`{"currency":"eur","amount":101}`))
	fmt.Println(a == b, a == c)
	// Output: true false
}

// The README's "library in ten lines", compiled with the tests (not run:
// it needs an etcd on 127.0.0.1:2379). docs_test in cmd/idem checks that
// the README shows exactly this body.
func Example_library() {
	ctx := context.Background()
	cli, _ := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}})
	store, _ := etcdstore.New(ctx, cli) // defaults: prefix /idem/, 24 h retention
	defer store.Close()

	key := etcdstore.Key{Tenant: "acme", ID: "8e03978e-40d5-43e8-bc93-6894a57f9324"} // from Idempotency-Key
	res, err := store.Do(ctx, key, []byte(`{"amount":100}`), func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
		return charge(ctx, 100, c.Token()) // runs once per key (again only after a takeover); pass the token downstream
	})
	// res.Body is the first answer, replayed to every retry (res.Replayed).
	// errors.Is(err, etcdstore.ErrMismatch): same key, other params (422, never retry).
	// errors.Is(err, etcdstore.ErrConflict): still in flight (409, retry later with the same key).
	_, _ = res, err
}

// charge stands for a non-idempotent downstream call that checks the
// fencing token.
func charge(_ context.Context, amount int, token fencing.Token) ([]byte, error) {
	return []byte(fmt.Sprintf(`{"charged":%d,"fence":%d}`, amount, token)), nil
}
