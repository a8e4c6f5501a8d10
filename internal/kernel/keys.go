package kernel

// Keys lays out idem's etcd keys under one prefix:
//
//	<prefix>k/<tenant>/<id>   records
//	<prefix>o/<owner>         owner (session) keys, on their session leases
//	<prefix>l/...             retention bucket keys
//	<prefix>x/<lease>         sweepers' locks, on their session leases
//	<prefix>z/...             compression dictionaries
//	<prefix>j/<name>          values (schedule cursors, limit slots, the shard set)
//	<prefix>epoch             the shard epoch
type Keys struct{ Prefix string }

// Record is the etcd key of tenant's record id.
func (k Keys) Record(tenant, id string) string { return k.Prefix + "k/" + tenant + "/" + id }

// Records is the prefix of every record.
func (k Keys) Records() string { return k.Prefix + "k/" }

// Owners is the prefix of the owner keys.
func (k Keys) Owners() string { return k.Prefix + "o/" }

// Owner is the owner key of a session.
func (k Keys) Owner(id string) string { return k.Prefix + "o/" + id }

// Values is the prefix of the values.
func (k Keys) Values() string { return k.Prefix + "j/" }

// Value is the etcd key of the value name.
func (k Keys) Value(name string) string { return k.Prefix + "j/" + name }

// Epoch is the etcd key of the shard epoch.
func (k Keys) Epoch() string { return k.Prefix + "epoch" }

// ShardSetValue is the name of the value that holds the shard set in force.
const ShardSetValue = "shard/set"

// Set is the etcd key of the shard set in force.
func (k Keys) Set() string { return k.Values() + ShardSetValue }
