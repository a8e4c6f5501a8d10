package main

import (
	"context"
	"fmt"
	"os"

	clientv3 "go.etcd.io/etcd/client/v3"
	"sigs.k8s.io/yaml"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/shard"
)

// backend is what serve needs of its store: one etcd cluster's
// (*etcdstore.Store) or a shard set's (*shard.Store).
type backend interface {
	idemhttp.Store
	Metrics() etcdstore.Metrics
	CheckFull(ctx context.Context) (bool, error)
	Owner() string
	Close() error
}

var (
	_ backend = (*etcdstore.Store)(nil)
	_ backend = (*shard.Store)(nil)
)

// shardsFile is --shards-file: the etcd clusters keys are spread over.
//
//	shards:
//	  - name: a
//	    endpoints: [https://etcd-a-0:2379, https://etcd-a-1:2379]
//	    cacert: /etc/idem/etcd-a/ca.crt    # and cert, key; user, password-env
//	  - name: b
//	    endpoints: [https://etcd-b-0:2379]
//	generation: 2                           # raise it with every placement change
//	placement: [a, b]                       # default: every shard
//	pin: {acme: a}                          # a tenant on one shard
//
// previous: {shards: [...]} is read only when no shard records a shard set
// yet (an upgrade from idem 0.4 in the middle of a change).
type shardsFile struct {
	Generation *int64 `json:"generation,omitempty"` // nil: absent (1)
	Shards     []struct {
		Name        string   `json:"name"`
		Endpoints   []string `json:"endpoints"`
		CACert      string   `json:"cacert,omitempty"`
		Cert        string   `json:"cert,omitempty"`
		Key         string   `json:"key,omitempty"`
		User        string   `json:"user,omitempty"`
		PasswordEnv string   `json:"password-env,omitempty"`
	} `json:"shards"`
	Placement []string          `json:"placement,omitempty"`
	Pin       map[string]string `json:"pin,omitempty"`
	Previous  *struct {
		Shards []string          `json:"shards"`
		Pin    map[string]string `json:"pin,omitempty"`
	} `json:"previous,omitempty"`
}

// readShards reads path: the shards' connection settings (each an
// etcdFlags, with base's dial timeout and prefix) and the placements.
func readShards(path string, base etcdFlags) ([]etcdFlags, []string, shard.Config, error) {
	var cfg shard.Config
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, cfg, fmt.Errorf("--shards-file: %w", err)
	}
	var f shardsFile
	if err := yaml.UnmarshalStrict(b, &f); err != nil {
		return nil, nil, cfg, fmt.Errorf("--shards-file %s: %w", path, err)
	}
	if len(f.Shards) == 0 {
		return nil, nil, cfg, fmt.Errorf("--shards-file %s: no shards", path)
	}
	var flags []etcdFlags
	var names []string
	for _, s := range f.Shards {
		e := etcdFlags{endpoints: s.Endpoints, cacert: s.CACert, cert: s.Cert, key: s.Key, user: s.User,
			dialTimeout: base.dialTimeout, prefix: base.prefix}
		if s.CACert == "" && s.Cert == "" && s.Key == "" {
			// A shard that names no TLS files uses --cacert, --cert and
			// --key (an injected sidecar's certificate, say).
			e.cacert, e.cert, e.key = base.cacert, base.cert, base.key
		}
		if len(s.Endpoints) == 0 {
			return nil, nil, cfg, fmt.Errorf("--shards-file %s: shard %q has no endpoints", path, s.Name)
		}
		if s.PasswordEnv != "" {
			if e.password = os.Getenv(s.PasswordEnv); e.password == "" {
				return nil, nil, cfg, fmt.Errorf("--shards-file %s: shard %q: %s is not set", path, s.Name, s.PasswordEnv)
			}
		}
		if _, err := e.tlsConfig(); err != nil {
			return nil, nil, cfg, fmt.Errorf("--shards-file %s: shard %q: %w", path, s.Name, err)
		}
		flags = append(flags, e)
		names = append(names, s.Name)
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: s.Name})
	}
	if f.Generation != nil {
		if *f.Generation < 1 {
			return nil, nil, cfg, fmt.Errorf("--shards-file %s: generation %d must be at least 1", path, *f.Generation)
		}
		cfg.Generation = *f.Generation
	}
	cfg.Placement = shard.Placement{Shards: f.Placement, Pin: f.Pin}
	if f.Previous != nil {
		cfg.Previous = &shard.Placement{Shards: f.Previous.Shards, Pin: f.Previous.Pin}
	}
	return flags, names, cfg, nil
}

// shardClients connects to every shard of cfg, filling in its clients. A
// shard whose client cannot be made (its etcd refused the user, say) has
// none, and its error is in errs.
func shardClients(flags []etcdFlags, cfg *shard.Config) (clis []*clientv3.Client, errs map[string]error) {
	errs = map[string]error{}
	for i, e := range flags {
		cli, err := e.client()
		if err != nil {
			errs[cfg.Shards[i].Name] = err
			continue
		}
		clis = append(clis, cli)
		cfg.Shards[i].Client = cli
	}
	return clis, errs
}

// shardConnects makes every shard of cfg connect when the store asks (at
// start, and in the background while its etcd does not answer).
func shardConnects(flags []etcdFlags, cfg *shard.Config) {
	for i := range flags {
		e := flags[i]
		cfg.Shards[i].Connect = func(context.Context) (*clientv3.Client, error) { return e.client() }
	}
}

// checkShards validates --shards-file at start: the file, and the shard
// set without connecting (a client placeholder per shard).
func checkShards(path string, base etcdFlags) error {
	_, _, cfg, err := readShards(path, base)
	if err != nil {
		return err
	}
	for i := range cfg.Shards {
		cfg.Shards[i].Client = &clientv3.Client{}
	}
	if _, err := shard.NewAdmin(cfg); err != nil {
		return fmt.Errorf("--shards-file %s: %w", path, err)
	}
	return nil
}
