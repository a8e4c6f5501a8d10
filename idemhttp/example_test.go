package idemhttp_test

import (
	"context"
	"fmt"
	"log"
	"net/http"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/idemhttp"
)

// A Go service makes its POST and PATCH handlers idempotent by key with the
// middleware, without a sidecar. Compiled with the tests, not run (it needs
// an etcd on 127.0.0.1:2379); docs/HTTP.md shows this body.
func ExampleMiddleware() {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}})
	if err != nil {
		log.Fatal(err)
	}
	store, err := etcdstore.New(context.Background(), cli)
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	mw, err := idemhttp.New(idemhttp.Config{Store: store})
	if err != nil {
		log.Fatal(err)
	}
	charges := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, _ := fencing.FromContext(r.Context()) // pass it to every downstream write
		fmt.Fprintf(w, `{"charge":"ch_1","fence":%d}`, token)
	})
	http.Handle("POST /charges", mw.Wrap(charges))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", nil))
}
