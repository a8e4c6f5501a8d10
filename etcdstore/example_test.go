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
