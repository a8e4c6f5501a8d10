package embedded

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"time"

	bolt "go.etcd.io/bbolt"
)

// ErrDamaged is returned by Start for a data directory whose database
// cannot be opened safely: etcd would crash on it (SIGBUS on a truncated
// file, a panic on a damaged page) instead of refusing it.
var ErrDamaged = errors.New("the etcd data directory is damaged")

// CheckDataDir opens the backend database of the member data directory
// dir, if it has one, read-only: its meta pages must verify, the file must
// hold every page they name, and every bucket's pages must read (a walk of
// every key, as etcd's own start walks every page to rebuild its free
// list: it costs about as much). A page that does not read is a panic in
// bbolt, recovered here.
func CheckDataDir(dir string) (err error) {
	db := filepath.Join(dir, "member", "snap", "db")
	info, err := os.Stat(db)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // a new member, or one bbolt has yet to write
	}
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrDamaged, db, err)
	}
	// A read of a page past the end of a truncated, memory-mapped file is
	// a fault: a panic here, not a crash.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("%w: %s: reading it failed (%v)", ErrDamaged, db, v)
		}
	}()
	b, err := bolt.Open(db, 0o400, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		if errors.Is(err, bolt.ErrTimeout) {
			return nil // in use by a running member: not ours to judge
		}
		return fmt.Errorf("%w: %s: %w", ErrDamaged, db, err)
	}
	defer b.Close()
	return b.View(func(tx *bolt.Tx) error {
		if need := tx.Size(); info.Size() < need {
			return fmt.Errorf("%w: %s is %d bytes, its pages need %d (truncated)", ErrDamaged, db, info.Size(), need)
		}
		return tx.ForEach(func(name []byte, bk *bolt.Bucket) error {
			c := bk.Cursor()
			for k, _ := c.First(); k != nil; k, _ = c.Next() {
			}
			return nil
		})
	})
}
