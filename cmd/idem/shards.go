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
//	placement: [a, b]                       # default: every shard
//	pin: {acme: a}                          # a tenant on one shard
//	previous: {shards: [a]}                 # while keys move after a change
type shardsFile struct {
	Shards []struct {
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
	cfg.Placement = shard.Placement{Shards: f.Placement, Pin: f.Pin}
	if f.Previous != nil {
		cfg.Previous = &shard.Placement{Shards: f.Previous.Shards, Pin: f.Previous.Pin}
	}
	return flags, names, cfg, nil
}

// shardClients connects to every shard of cfg, filling in its clients.
func shardClients(flags []etcdFlags, cfg *shard.Config) ([]*clientv3.Client, error) {
	var clis []*clientv3.Client
	for i, e := range flags {
		cli, err := e.client()
		if err != nil {
			for _, c := range clis {
				c.Close()
			}
			return nil, fmt.Errorf("shard %s: %w", cfg.Shards[i].Name, err)
		}
		clis = append(clis, cli)
		cfg.Shards[i].Client = cli
	}
	return clis, nil
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
