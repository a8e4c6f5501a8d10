package etcdstore

import (
	"context"

	"github.com/idem-dev/idem/internal/storeext"
)

// The parts of the store that exist for idem's own packages (shard, jobs,
// the idem command) are reached through package storeext's hooks, typed by
// package storex: they are not this package's API (see storeext).
func init() {
	storeext.Forward = (*Store).forwardKey
	storeext.RaiseEpoch = (*Store).raiseEpoch
	storeext.Epoch = (*Store).currentEpoch
	storeext.ShardSet = (*Store).shardSet
	storeext.LoadShardSet = (*Store).loadShardSet
	storeext.UnderShardSet = underShardSet
	storeext.ValueUnderShardSet = valueUnderShardSet
	storeext.OnSession = onSession
	storeext.WithoutCreate = withoutCreate
	storeext.ReplaceMoved = replaceMoved
	storeext.Routed = routed
	storeext.IfValue = ifValue
	storeext.IfValueThen = ifValueThen
	storeext.WithEpochs = withEpochs
	storeext.Retained = retained
	storeext.SetValue = (*Store).setValue
	storeext.DeleteValue = (*Store).deleteValue
	storeext.GetValue = (*Admin).getValue
	storeext.Values = (*Admin).listValues
	storeext.ClaimHeld = (*Admin).claimHeld
	storeext.Peek = (*Admin).peek
	storeext.BumpEpoch = (*Admin).bumpEpoch
	storeext.AdminEpoch = (*Admin).readEpoch
	storeext.SettingsOf = settingsOf
	storeext.SameAttempt = sameAttempt
	storeext.Follow = func(s *Store, ctx context.Context, tenant string, o followOptions) (any, error) {
		f, err := s.follow(ctx, tenant, o)
		if err != nil {
			return nil, err
		}
		return f, nil
	}
	storeext.ReadStats = (*Admin).stats
	storeext.WithTxnObserver = withTxnObserver
	storeext.StoreOf = (*Claim).storeOf
	storeext.OwnerAlive = (*Admin).ownerLives
	storeext.DecodeRecord = (*Admin).decodeRecord
}
