// Package embedded starts etcd members inside the current process, configured
// the way idem needs them: lease checkpointing on (so a retention lease is not
// postponed by every leader change), auto-compaction and a backend quota set,
// every URL explicit (embed defaults to the well-known ports otherwise).
//
// It is used by `idem serve` for its single-node default and by the test
// harness for multi-member clusters.
package embedded

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"time"

	"go.etcd.io/etcd/pkg/v3/featuregate"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Config describes one member. Name, Dir, ClientURL and PeerURL are required.
type Config struct {
	Name      string
	Dir       string
	ClientURL string // listened on and advertised, e.g. http://127.0.0.1:2379
	PeerURL   string // listened on and advertised, e.g. http://127.0.0.1:2380
	// AdvertisePeerURL, when set, is advertised instead of PeerURL: the
	// address of a proxy in front of the member's peer port.
	AdvertisePeerURL string

	// InitialCluster is "name=peerURL,..." for every member. Empty means a
	// single-member cluster of this member alone.
	InitialCluster string
	// Existing is true when joining or restarting into an existing cluster.
	Existing bool
	// ClusterToken separates clusters that share a network. Default "idem".
	ClusterToken string

	// QuotaBytes is the backend quota. 0 means 2 GiB, etcd's default.
	QuotaBytes int64
	// CompactionRetention is the periodic auto-compaction window, for example
	// "1h". Empty means "1h"; "0" turns auto-compaction off.
	CompactionRetention string

	// TickMs and ElectionMs are the raft heartbeat and election timeouts.
	// Zero means etcd's defaults (100 ms and 1000 ms).
	TickMs, ElectionMs uint

	// NoFsync turns off fsync. Only for tests where durability is not under test.
	NoFsync bool

	// ClientTLS, when its CertFile is set, serves clients over TLS.
	ClientTLS TLS

	// Logger receives etcd's logs. Nil means no logs.
	Logger *zap.Logger

	// Configure, when set, is called last to adjust the embed.Config.
	Configure func(*embed.Config)
}

// TLS names certificate files for a listener.
type TLS struct {
	CertFile, KeyFile, TrustedCAFile string
	ClientCertAuth                   bool // require client certificates signed by TrustedCAFile
}

// Start starts the member and waits until it has joined the cluster and can
// serve, or until ctx ends. On error nothing is left running.
func Start(ctx context.Context, c Config) (*embed.Etcd, error) {
	cfg, err := c.embedConfig()
	if err != nil {
		return nil, err
	}
	guard := new(stopGuard)
	cfg.GRPCAdditionalServerOptions = append(cfg.GRPCAdditionalServerOptions, guard.options()...)
	if err := CheckDataDir(c.Dir); err != nil {
		return nil, fmt.Errorf("start etcd member %s: %w (restore it from a snapshot into a new directory: idem snapshot restore)", c.Name, err)
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("start etcd member %s: %w", c.Name, err)
	}
	guard.srv.Store(e.Server)
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("start etcd member %s: %w", c.Name, err)
	case <-ctx.Done():
		e.Server.Stop() // a member that cannot reach quorum never becomes ready
		e.Close()
		return nil, fmt.Errorf("start etcd member %s: %w", c.Name, context.Cause(ctx))
	}
}

func (c Config) embedConfig() (*embed.Config, error) {
	if c.Name == "" || c.Dir == "" || c.ClientURL == "" || c.PeerURL == "" {
		return nil, errors.New("embedded etcd: name, data dir, client URL and peer URL are required")
	}
	curl, err := url.Parse(c.ClientURL)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd client URL: %w", err)
	}
	purl, err := url.Parse(c.PeerURL)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd peer URL: %w", err)
	}
	apurl := purl
	if c.AdvertisePeerURL != "" {
		if apurl, err = url.Parse(c.AdvertisePeerURL); err != nil {
			return nil, fmt.Errorf("embedded etcd advertised peer URL: %w", err)
		}
	}
	cfg := embed.NewConfig()
	cfg.Name = c.Name
	cfg.Dir = c.Dir
	cfg.ListenClientUrls = []url.URL{*curl}
	cfg.AdvertiseClientUrls = []url.URL{*curl}
	cfg.ListenPeerUrls = []url.URL{*purl}
	cfg.AdvertisePeerUrls = []url.URL{*apurl}
	cfg.InitialCluster = c.InitialCluster
	if cfg.InitialCluster == "" {
		cfg.InitialCluster = c.Name + "=" + apurl.String()
	}
	cfg.ClusterState = embed.ClusterStateFlagNew
	if c.Existing {
		cfg.ClusterState = embed.ClusterStateFlagExisting
	}
	cfg.InitialClusterToken = c.ClusterToken
	if cfg.InitialClusterToken == "" {
		cfg.InitialClusterToken = "idem"
	}
	cfg.QuotaBackendBytes = c.QuotaBytes
	cfg.AutoCompactionMode = embed.CompactorModePeriodic
	cfg.AutoCompactionRetention = c.CompactionRetention
	if cfg.AutoCompactionRetention == "" {
		cfg.AutoCompactionRetention = "1h"
	}
	if c.TickMs > 0 {
		cfg.TickMs = c.TickMs
	}
	if c.ElectionMs > 0 {
		cfg.ElectionMs = c.ElectionMs
	}
	cfg.UnsafeNoFsync = c.NoFsync
	if c.ClientTLS.CertFile != "" {
		cfg.ClientTLSInfo.CertFile = c.ClientTLS.CertFile
		cfg.ClientTLSInfo.KeyFile = c.ClientTLS.KeyFile
		cfg.ClientTLSInfo.TrustedCAFile = c.ClientTLS.TrustedCAFile
		cfg.ClientTLSInfo.ClientCertAuth = c.ClientTLS.ClientCertAuth
	}
	// Without checkpointing, every leader change resets every lease to its
	// full TTL: a 25 h retention lease could be postponed by a day at each
	// election. Persisting the checkpoint keeps it across restarts too.
	gate := cfg.ServerFeatureGate.(featuregate.MutableFeatureGate)
	if err := gate.Set("LeaseCheckpoint=true,LeaseCheckpointPersist=true"); err != nil {
		return nil, fmt.Errorf("embedded etcd feature gates: %w", err)
	}
	lg := c.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg)
	if c.Configure != nil {
		c.Configure(cfg)
	}
	return cfg, nil
}

// ReadyTimeout is a reasonable bound for Start on a loaded machine.
const ReadyTimeout = 60 * time.Second
