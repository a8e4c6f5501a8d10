package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/client/v3/snapshot"
	etcdutl "go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

const snapshotUsage = `usage: idem snapshot save|restore|bump-epoch [flags]

  save        take a snapshot of etcd (every idem key, lease and record) into a file:
              idem snapshot save --endpoints URL [--cacert ...] (--file F | --dir D [--keep N])
  restore     restore a snapshot into a new data directory for idem serve's embedded etcd:
              idem snapshot restore --file F --data-dir D
              (idem serve raises the shard epoch on its first start from D)
  bump-epoch  after restoring a cluster with etcdutl, raise its shard epoch, so that
              fencing tokens keep growing: idem snapshot bump-epoch --endpoints URL

Run "idem snapshot save -h" for the flags.
`

func snapshotCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, snapshotUsage)
		return errUsage
	}
	switch args[0] {
	case "save":
		return snapshotSave(ctx, args[1:], stdout, stderr)
	case "restore":
		return snapshotRestore(ctx, args[1:], stdout, stderr)
	case "bump-epoch":
		return snapshotBumpEpoch(ctx, args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, snapshotUsage)
		return nil
	}
	fmt.Fprint(stderr, snapshotUsage)
	return usageError{fmt.Errorf("unknown snapshot command %q", args[0])}
}

// withUsage gives fs the usage every idem command prints: its synopsis,
// then its flags.
func withUsage(fs *flag.FlagSet, stderr io.Writer, synopsis string) {
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: idem %s\n\nFlags:\n", synopsis)
		fs.PrintDefaults()
	}
}

// snapshotPrefix names the files save writes in --dir; --keep prunes only
// those.
const snapshotPrefix = "idem-etcd-"

func snapshotSave(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("snapshot save", flag.ContinueOnError)
	fs.SetOutput(stderr)
	withUsage(fs, stderr, "snapshot save --endpoints URL [--cacert F --cert F --key F | --user U] (--file F | --dir D [--keep N])")
	var e etcdFlags
	e.registerConnection(fs, []string{socketURL("idem-data")}) // a snapshot is all of etcd: no --prefix
	file := fs.String("file", "", "write the snapshot to this file")
	dir := fs.String("dir", "", "write the snapshot to a new file in this directory, named "+snapshotPrefix+"<UTC time, ms>.db")
	keep := fs.Int("keep", 0, "with --dir: keep this many snapshots, deleting the oldest (0: keep all)")
	timeout := fs.Duration("command-timeout", 10*time.Minute, "timeout of the command")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch {
	case fs.NArg() != 0:
		return usageError{fmt.Errorf("snapshot save takes no arguments, got %q", fs.Args())}
	case (*file == "") == (*dir == ""):
		return usageError{errors.New("snapshot save: give one of --file and --dir")}
	case *keep < 0 || *keep > 0 && *dir == "":
		return usageError{errors.New("snapshot save: --keep is a count of snapshots in --dir, 0 or more")}
	}
	cfg, err := e.config()
	if err != nil {
		return usageError{err}
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	path := *file
	if *file != "" {
		if _, err := os.Stat(*file); err == nil {
			return usageError{fmt.Errorf("--file %s exists: snapshot save never overwrites a backup; remove it or name another file", *file)}
		}
	}
	if *dir != "" {
		if err := os.MkdirAll(*dir, 0o700); err != nil {
			return fmt.Errorf("--dir: %w", err)
		}
		path = filepath.Join(*dir, snapshotPrefix+time.Now().UTC().Format("20060102T150405.000Z")+".db")
		if _, err := os.Stat(path); err == nil {
			return fmt.Errorf("snapshot save: %s exists", path)
		}
	}
	// A snapshot comes from one member: try each endpoint until one gives
	// a whole snapshot (SaveWithVersion writes to path.part and renames it
	// only once the stream is complete and ends with etcd's checksum; the
	// checksum itself is verified at restore).
	// It is written under a name of its own beside path, then linked to
	// path, which fails if path exists by then (another save, a file
	// copied there): a backup is never replaced.
	tmp := fmt.Sprintf("%s.saving-%d-%d", path, os.Getpid(), time.Now().UnixNano())
	defer os.Remove(tmp)
	var errs []error
	for _, ep := range cfg.Endpoints {
		one := cfg
		one.Endpoints = []string{ep}
		ver, err := snapshot.SaveWithVersion(ctx, zap.NewNop(), one, tmp)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", ep, err))
			continue
		}
		if err := os.Link(tmp, path); err != nil {
			if errors.Is(err, os.ErrExist) {
				return fmt.Errorf("snapshot save: %s appeared while the snapshot was taken: it is left as it was; name another file", path)
			}
			return fmt.Errorf("snapshot save: %w", err)
		}
		info, err := os.Stat(path)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "saved %s (%d bytes) from %s, etcd %s\n", path, info.Size(), ep, ver)
		if *keep > 0 {
			return pruneSnapshots(*dir, *keep, stdout)
		}
		return nil
	}
	return fmt.Errorf("snapshot save: no endpoint gave a snapshot: %w", errors.Join(errs...))
}

// pruneSnapshots deletes the oldest of save's files in dir beyond keep.
func pruneSnapshots(dir string, keep int, stdout io.Writer) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var names []string
	for _, en := range entries {
		if n := en.Name(); en.Type().IsRegular() && strings.HasPrefix(n, snapshotPrefix) && strings.HasSuffix(n, ".db") {
			names = append(names, n)
		}
	}
	slices.Sort(names) // the UTC time in the name sorts oldest first
	for len(names) > keep {
		if err := os.Remove(filepath.Join(dir, names[0])); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "deleted %s\n", filepath.Join(dir, names[0]))
		names = names[1:]
	}
	return nil
}

func snapshotRestore(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("snapshot restore", flag.ContinueOnError)
	fs.SetOutput(stderr)
	withUsage(fs, stderr, "snapshot restore --file F --data-dir D [--embedded-peer-url URL] [--bump-revision N]")
	file := fs.String("file", "", "the snapshot to restore")
	dataDir := fs.String("data-dir", "", "the new data directory (must not exist yet): give it to idem serve --data-dir")
	peer := fs.String("embedded-peer-url", "http://127.0.0.1:2380", "the peer URL idem serve's embedded etcd will use (its --embedded-peer-url)")
	bump := fs.Uint64("bump-revision", 1_000_000_000, "raise etcd's revision by this much, marking the old ones compacted: fencing tokens (revisions) after the restore stay greater than any handed out before it (0: no bump)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch {
	case fs.NArg() != 0:
		return usageError{fmt.Errorf("snapshot restore takes no arguments, got %q", fs.Args())}
	case *file == "" || *dataDir == "":
		return usageError{errors.New("snapshot restore: --file and --data-dir are required")}
	}
	if _, err := os.Stat(*dataDir); err == nil {
		return usageError{fmt.Errorf("--data-dir %s exists: restore into a new directory, then point idem serve at it", *dataDir)}
	}
	if _, err := os.Stat(*file); err != nil {
		return usageError{fmt.Errorf("--file: %w", err)}
	}
	// All or nothing: the restore writes a directory beside --data-dir and
	// renames it into place only once it is whole; a failure leaves
	// nothing behind, so the same command can run again.
	parent := filepath.Dir(filepath.Clean(*dataDir))
	// The first missing directory above --data-dir, made here and removed
	// again if the restore fails.
	made := ""
	for d := parent; ; d = filepath.Dir(d) {
		if _, err := os.Stat(d); err == nil || filepath.Dir(d) == d {
			break
		}
		made = d
	}
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return fmt.Errorf("snapshot restore: --data-dir: %w", err)
	}
	restored := false
	defer func() {
		if !restored && made != "" {
			os.RemoveAll(made)
		}
	}()
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(*dataDir)+".restoring-")
	if err != nil {
		return fmt.Errorf("snapshot restore: %w", err)
	}
	work := filepath.Join(tmp, "data")
	defer os.RemoveAll(tmp)
	// The member idem serve starts: name "idem", cluster token "idem"
	// (internal/embedded). A restore makes a new cluster of one member
	// with the snapshot's keys and leases; leases restart their TTLs. The
	// revision jumps ahead, so that no fencing token is handed out twice
	// and none goes backwards.
	err = etcdutl.NewV3(zap.NewNop()).Restore(etcdutl.RestoreConfig{
		SnapshotPath:        *file,
		Name:                "idem",
		OutputDataDir:       work,
		PeerURLs:            []string{*peer},
		InitialCluster:      "idem=" + *peer,
		InitialClusterToken: "idem",
		RevisionBump:        *bump,
		MarkCompacted:       *bump > 0,
	})
	if err != nil {
		return fmt.Errorf("snapshot restore: %s is not a whole etcd snapshot (truncated, damaged, or not a snapshot): %s; nothing was written", *file, firstLine(err.Error(), 200))
	}
	// The shard epoch is a key like any other: the snapshot has the one
	// of its time, and tokens (epoch<<44 | revision) of keys moved in from
	// other shards since would go backwards. idem serve raises it on its
	// first start from this directory, before it serves, then removes the
	// marker.
	if err := os.WriteFile(filepath.Join(work, restoredMarker), []byte(restoredMarkerText), 0o600); err != nil {
		return fmt.Errorf("snapshot restore: %w", err)
	}
	if err := os.Rename(work, *dataDir); err != nil {
		return fmt.Errorf("snapshot restore: moving the restored directory into place: %w", err)
	}
	restored = true
	fmt.Fprintf(stdout, "restored %s into %s: start idem serve --data-dir %s\n", *file, *dataDir, *dataDir)
	return nil
}

// restoredMarker, in an embedded etcd's data directory, says that it was
// restored from a snapshot and its shard epoch has not been raised since.
const restoredMarker = "idem-restored"

const restoredMarkerText = "restored by idem snapshot restore: idem serve raises the shard epoch on its next start, then removes this file\n"

// snapshotBumpEpoch raises the shard epoch of a restored cluster.
func snapshotBumpEpoch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("snapshot bump-epoch", flag.ContinueOnError)
	fs.SetOutput(stderr)
	withUsage(fs, stderr, "snapshot bump-epoch (--endpoints URL [--prefix P] | --shards-file F --shard NAME) [--by N]")
	var e etcdFlags
	e.register(fs, []string{socketURL("idem-data")})
	by := fs.Int64("by", storex.DefaultRestoreEpochBump, "raise the epoch by this much: more than the epoch was raised between the snapshot and the restore (keys moved in from other shards raise it by one each time)")
	shardsFile := fs.String("shards-file", "", "with --shard: the shard set the restored shard belongs to; its epoch is raised --by above the greatest epoch of the set")
	shardName := fs.String("shard", "", "with --shards-file: the shard restored")
	timeout := fs.Duration("command-timeout", time.Minute, "timeout of the command")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch {
	case fs.NArg() != 0:
		return usageError{fmt.Errorf("snapshot bump-epoch takes no arguments, got %q", fs.Args())}
	case *by < 1:
		return usageError{fmt.Errorf("--by %d: must be at least 1", *by)}
	case (*shardsFile == "") != (*shardName == ""):
		return usageError{fmt.Errorf("--shards-file and --shard go together")}
	}
	if *shardsFile != "" {
		return bumpShardEpoch(ctx, e, *shardsFile, *shardName, *by, *timeout, stdout)
	}
	if _, err := e.config(); err != nil {
		return usageError{err}
	}
	cli, err := e.client()
	if err != nil {
		return err
	}
	defer cli.Close()
	adm, err := etcdstore.NewAdmin(cli, etcdstore.WithPrefix(e.prefix))
	if err != nil {
		return usageError{err}
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	epoch, err := storex.BumpEpoch(adm, ctx, *by)
	if err != nil {
		if errors.Is(err, etcdstore.ErrInvalidArgument) {
			return usageError{err}
		}
		return fmt.Errorf("snapshot bump-epoch: %w", err)
	}
	fmt.Fprintf(stdout, "shard epoch of %s raised by %d to %d\n", e.prefix, *by, epoch)
	return nil
}

// bumpShardEpoch raises the epoch of shard name of the set in file to by
// above the greatest epoch of the set's shards as they stand: a key may
// have moved onto the restored shard, since its snapshot, from a shard of
// a greater epoch, and its tokens there must keep growing.
func bumpShardEpoch(ctx context.Context, base etcdFlags, file, name string, by int64, timeout time.Duration, stdout io.Writer) error {
	flags, names, cfg, err := readShards(file, base)
	if err != nil {
		return usageError{err}
	}
	if !slices.Contains(names, name) {
		return usageError{fmt.Errorf("--shard %q: not a shard of %s (%v)", name, file, names)}
	}
	clis, errs := shardClients(flags, &cfg)
	defer func() {
		for _, c := range clis {
			c.Close()
		}
	}()
	for _, n := range names {
		if errs[n] != nil {
			return fmt.Errorf("shard %s: %w", n, errs[n])
		}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	high, own := int64(0), int64(0)
	admins := map[string]*etcdstore.Admin{}
	for i, n := range names {
		adm, err := etcdstore.NewAdmin(cfg.Shards[i].Client, etcdstore.WithPrefix(base.prefix))
		if err != nil {
			return usageError{err}
		}
		admins[n] = adm
		e, err := storex.AdminEpoch(adm, ctx)
		if err != nil {
			return fmt.Errorf("shard %s: %w", n, err)
		}
		high = max(high, e)
		if n == name {
			own = e
		}
	}
	epoch, err := storex.BumpEpoch(admins[name], ctx, high+by-own)
	if err != nil {
		return fmt.Errorf("snapshot bump-epoch: shard %s: %w", name, err)
	}
	fmt.Fprintf(stdout, "shard epoch of shard %s raised from %d to %d (the set's greatest was %d)\n", name, own, epoch, high)
	return nil
}

// firstLine is the first line of s, cut at n bytes: etcd's errors can be a
// wall of numbers.
func firstLine(s string, n int) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > n {
		s = s[:n] + "..."
	}
	return s
}
