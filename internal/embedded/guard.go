package embedded

import (
	"context"
	"sync/atomic"

	"go.etcd.io/etcd/server/v3/etcdserver"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// stopGuard keeps a member that is stopping from taking its process down.
//
// etcd closes its backend when the server stops, but its gRPC servers go on
// accepting requests until embed.Etcd.Close stops them; a read that reaches
// the closed backend in between panics (etcd-io/etcd#14256, #17223). A
// member stopped at once (a crash in the test harness: HardStop, then
// Close) has that window for as long as Close takes to reach its servers,
// and in a process that embeds several members the panic ends all of them.
// The guard answers Unavailable once the server is stopping, as a stopped
// server's clients see it, and turns a panic of a request that raced the
// stop into the same answer. A panic while the server is not stopping is
// a bug and goes on up.
type stopGuard struct {
	srv atomic.Pointer[etcdserver.EtcdServer]
}

var errStopping = status.Error(codes.Unavailable, "etcdserver: server stopped")

func (g *stopGuard) stopping() bool {
	s := g.srv.Load()
	if s == nil {
		return false
	}
	select {
	case <-s.StoppingNotify():
		return true
	default:
		return false
	}
}

// recover must be deferred directly; it replaces *err when the panic raced
// the stop.
func (g *stopGuard) recover(err *error) {
	r := recover()
	if r == nil {
		return
	}
	if !g.stopping() {
		panic(r)
	}
	*err = errStopping
}

func (g *stopGuard) unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (resp any, err error) {
	if g.stopping() {
		return nil, errStopping
	}
	defer g.recover(&err)
	return h(ctx, req)
}

func (g *stopGuard) stream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) (err error) {
	if g.stopping() {
		return errStopping
	}
	defer g.recover(&err)
	return h(srv, ss)
}

func (g *stopGuard) options() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(g.unary),
		grpc.ChainStreamInterceptor(g.stream),
	}
}
