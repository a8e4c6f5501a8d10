// Package jobs runs idempotent jobs across processes and data centres on
// an etcdstore.Store: each job runs to its end once, resuming where it
// stopped when its worker dies or is cut off, and each occurrence of a
// schedule becomes one job however many schedulers run it.
//
// A job is a key (its id, in the queue's tenant), a kind and parameters.
// Submit writes it, parameters included, in one etcd Txn; any Worker that
// registered its kind may run it. A Kind is an ordered list of named steps
// (Brandur Leach's "atomic phases"; Stripe's recovery points): every step
// runs under the job's claim, with its context and fencing token, and
// finishing a step is a fenced checkpoint. A worker that takes the job over
// resumes at the first unfinished step. A step whose effect lives in etcd
// (Run.Commit) commits it in the same Txn as that checkpoint.
//
// Every Worker runs a completer: it follows the queue and the live sessions
// on etcd Watches, and claims the jobs that wait for a worker (queued, due
// for a retry, or abandoned by a worker that died, was cut off longer than
// its session's TTL, or passed its Kind's Deadline), with bounded
// concurrency. A step that fails is retried with backoff, failed, or
// compensated, as its OnError says; attempts are counted in the job's
// record, and a job that keeps failing is parked for an operator (Retry,
// Cancel; `idem jobs`). A Scheduler submits a Schedule's occurrences (a
// cron expression or an interval) as jobs whose ids come from the schedule,
// so every data centre's scheduler names an occurrence alike; its Overlap
// policy (allow all, skip, buffer one) says what an occurrence does while
// the previous one runs, and a schedule can be paused (PauseSchedule) and
// backfilled (Backfill).
//
// A step can wait durably (Run.Sleep, Run.Await for an event that
// Queue.Signal delivers once): the wait is saved with the job, no worker
// holds the job meanwhile, and a worker resumes it when the wait is over.
// Submit can refuse a duplicate (RefuseDuplicate, SubmissionID) and keep an
// id for less than the store's retention (DedupWindow).
//
// # What is guaranteed
//
//   - A job has at most one live claim at a time, and each claim that takes
//     it over has a greater fencing token (etcdstore's guarantees).
//   - A finished step is never run again for its job: its checkpoint is in
//     the record, written only while the claim that ran it held the job,
//     and every later claim inherits it.
//   - A step's etcd effect (Run.Commit) is applied exactly once: atomically
//     with its checkpoint, which a retry after a lost reply recognises.
//   - A worker that was taken over can no longer checkpoint, complete or
//     park the job (etcdstore.ErrFenced), and its token is lower than the
//     new worker's, so a downstream that keeps the highest token refuses it.
//   - Every attempt is counted before its steps run, by the takeover that
//     starts it, so a job that kills its workers is parked after
//     MaxAttempts too.
//   - An occurrence of a schedule is one job id on every scheduler, however
//     their clocks differ; it is submitted once by whichever comes first.
//   - A job ends once: succeeded, failed or cancelled is its saved
//     outcome, and Wait, Get and every later Submit of its id see it until
//     the store's retention ends.
//
// # What is not
//
//   - A step that did not finish may run again (its worker died, or was cut
//     off, after it acted and before its checkpoint landed): its effects
//     outside etcd happen once only if the downstream deduplicates them by
//     Run.StepKey, and late ones are refused only if it checks Run.Token.
//     A slow worker that was taken over may still be running the step.
//   - Times (a retry's backoff, RunAt, a Kind's Deadline, when a schedule's
//     occurrence comes) are read on each machine's clock: keep clocks
//     synchronised. A scheduler whose clock is ahead submits occurrences
//     early; it never submits one twice.
//   - A job is remembered for the store's retention after its last write;
//     after that its id names a new job. A parked job must be retried or
//     cancelled within it, and a step must write within it.
//   - Schedules across shards of a shard set are not supported: a Queue
//     runs on one etcdstore.Store.
package jobs
