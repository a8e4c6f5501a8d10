// Command mutate measures the fault-schedule explorer by mutation: it puts
// small bugs into idem's production code, one at a time, runs the
// explorer on each, and prints which it found (killed), after how many
// schedules and seconds, and the kill rate.
//
//	go run ./scripts/mutate                  # every mutant, the CI budget each
//	go run ./scripts/mutate -budget 3m       # a shorter budget each
//	go run ./scripts/mutate -only 'epoch|review' # the mutants whose name matches
//	go run ./scripts/mutate -check           # every mutant still applies
//	go run ./scripts/mutate -list            # list them
//
// Each mutant is a text replacement that must match its file exactly
// once, so a mutant that no longer applies fails loudly instead of
// testing nothing. The file is restored after each run, and on
// interrupt. A mutant survives when the explorer's budget passes without a
// violation: a gap in the explorer, to be widened until it is found.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"
)

type mutant struct {
	name     string // subsystem: what the bug does
	file     string
	old, new string
}

// model reports whether m is a mutant of the kernel (internal/kernel), run
// against the model checker (its budget: -model-budget); the others run
// against the fault-schedule explorer. The kernel's rules for a schedule's
// plan are measured by the explorer's schedule worlds: the model checker
// has no schedulers.
func (m mutant) model() bool {
	_, direct := contract[m.name]
	return strings.HasPrefix(m.file, "internal/kernel/") && !explorerKernel[m.name] && !tableKernel[m.name] && !direct
}

// tableKernel are the kernel's mutants measured by its decision table
// (TestDecisionTable, seconds): rules whose world the model checker's
// scopes do not reach. A ReplaceMoved claim whose every try is lost over
// a home's Moved record needs two faults in the shard scope, which has
// one; the model has no enqueues. (Each was found by a review, with an
// etcdstore test that fails with it: TestReviewReaperIgnoresLostReplaceMovedWrite,
// TestReviewEnqueueIfValueRefusedByEpochIsNotValueChanged.)
var tableKernel = map[string]bool{
	"reaper: a Moved record the lost claim saw needs no fence":                                                 true,
	"enqueue: a refusal by the shard epoch is taken for the value's moving":                                    true,
	"claim (review): while etcd is full, our own landed claim is won without asking whether its session lives": true,
}

// backstops are the explorer's mutants that a deterministic test in CI
// also catches: a hand-written test of the very promise the mutant breaks
// (most were written for the defect the mutant puts back). When the
// explorer's budget passes without finding the mutant, its backstop runs,
// and the mutant counts as found in CI, by that test; the report says
// which, so that a gap in the explorer's reach stays visible. -backstops
// runs only the backstops (seconds each).
var backstops = map[string]backstop{
	"schedules (review): an occurrence the cursor says was submitted is submitted again once gone":         {"./jobs", "TestReviewEndedOccurrenceGoneEarlyIsNotSubmittedAgain"},
	"batching (defect 1): a caller that leaves while its write flies is told it was not sent":              {"./etcdstore", "TestBatchedClaimWhoseCallerLeavesDoesNotHoldTheKey"},
	"shards: a route is guarded by a newer set its shard holds instead of being refused":                   {"./shard", "TestRouteByAnOlderSetIsRefusedWhereANewerOneIsHeld"},
	"dictionaries: a copy whose write failed counts as made":                                               {"./etcdstore", "TestRecordNeverNamesADictionaryWithoutItsCopy"},
	"shards (defect 1): a change ends the hand-over before the drain":                                      {"./shard", "TestHandOverEndsWhenDrained"},
	"shards (review): a first set is installed while a shard does not answer":                              {"./shard", "TestChangeInstalledWhileTheSetInForceIsUnreachable"},
	"shards (review): the drain marks a shard without deleting its expired records":                        {"./shard", "TestDrainRacesATakeoverInFlight"},
	"schedules (review): a forgotten job's record is not deleted before the next occurrence":               {"./jobs", "TestReviewForgottenJobIsNotTakenOverBesideTheNext"},
	"limits: a rate slot is taken before its time has come":                                                {"./jobs", "TestReviewRateSlotWrittenLateDoesNotStartTheAttempt"},
	"cache: serves entries however stale":                                                                  {"./etcdstore/internal/cache", "TestStaleCacheAnswersNothing"},
	"reaper: a WithoutSession claim's unknown outcome starts a reaper":                                     {"./etcdstore", "TestReview3WithoutSessionLostClaimStartsNoReaper"},
	"batching: a batch's lost reply is reported as not applied":                                            {"./etcdstore/internal/send", "TestBatchLostReplyMayHaveLandedForEveryMember"},
	"reaper (issue 29): a pending final write does not survive session loss":                               {"./etcdstore", "TestPendingOutcomeSurvivesSessionLoss"},
	"reaper (issue 29): a finished work's outcome is not kept past its claim's deadline while it is saved": {"./etcdstore", "TestPendingOutcomeSurvivesItsDeadline"},
	"shards: a claim on a key's old shard may create a record there":                                       {"./shard", "TestDrainRacesATakeoverInFlight"},
	"jobs (review): a last step's ops commit although the job's end cannot fit":                            {"./jobs", "TestSucceededJobNearTheLimitKeepsItsState"},
	"explorer (issue 38): a takeover of a dead idem's claim forwards again (the explorer's 2b)":            {"./cmd/idem", "TestKilledAfterUpstreamCallNoDoubleEffect"},
}

type backstop struct{ pkg, test string }

// contract are the mutants of the store contract (idem.Store) and of the
// layers that read its records, each run against the deterministic test
// that is its oracle: the conformance suite (package idemtest, run by
// TestConformance* against etcdstore on one and three members and shard
// sets of one and three shards and during a hand-over), or a test of the
// layer. Each puts back a defect of issue 37.
var contract = map[string]backstop{
	"store (issue 37): a replay is read serializably, so a lagging member replays deleted records":   {"./etcdstore", "TestConformanceThreeMembersOneHeldBehind"},
	"shards (issue 37): EvictIf of a key no shard holds fails with not found":                        {"./shard", "TestConformanceShards"},
	"records (issue 37): a takeover forgets what the record is":                                      {"./etcdstore", "TestConformanceOneMember"},
	"records (issue 37): a claim's write forgets what the record is":                                 {"./etcdstore", "TestConformanceOneMember"},
	"jobs (issue 37): a plain key whose work failed is read as a failed job":                         {"./jobs", "TestAPlainKeyIsNeverAJob"},
	"jobs (issue 37): a claim that replays an ended job counts as a run":                             {"./jobs", "TestReplayOfAReplacedJobIsNotARun"},
	"docs (issue 37): JOBS.md says a job's claim is two Txns":                                        {"./jobs", "TestJobCostTableIsMeasured"},
	"proxy (issue 38): a takeover of a dead idem's claim forwards the request again":                 {"./cmd/idem", "TestKilledAfterUpstreamCallNoDoubleEffect"},
	"grpc (issue 38): a takeover of a dead server's claim runs the handler again":                    {"./idemgrpc", "TestTakeoverAfterACrashDoesNotRunTheHandlerAgain"},
	"limits (issue 38): a Key function's panic is not recovered":                                     {"./jobs", "TestALimitKeyThatPanicsFailsItsJobAlone"},
	"schedules (issue 38): a Params function's panic is not recovered":                               {"./jobs", "TestAParamsFunctionThatPanicsSkipsItsOccurrence"},
	"jobs (issue 38): a step declared to wait past the retention is registered":                      {"./jobs", "TestAKindThatWaitsPastTheRetentionIsRefusedAtRegistration"},
	"schedules (issue 38): a new schedule's cursor starts MaxSkew back":                              {"./jobs", "TestANewScheduleDoesNotRunItsPast"},
	"schedules (issue 38): after an outage the skew window runs MaxSkew's occurrences at once":       {"./jobs", "TestAnOutageRunsOnlyWhatCatchUpSays"},
	"fresh machine (issue 38): the README's test command installs nothing":                           {"./cmd/idem", "TestTheREADMETestCommandInstallsWhatTheTestsNeed"},
	"schedules (issue 38 review): an outage is judged by the first occurrence alone":                 {"./jobs", "TestReview6AFastSchedulerJoiningARunningFleetSkipsNothing"},
	"schedules (issue 38 review): a scheduler moving the cursor does not say when":                   {"./jobs", "TestTheCursorSaysWhenASchedulerLastWroteIt"},
	"restore (issue 38 review): a detector raises only when revisions say so":                        {"./etcdstore", "TestReview6ClusterIDChangeRaisesAboveTokensOfGoneProcesses"},
	"restore (issue 38 review): a plain store's claims do not compare the epoch":                     {"./etcdstore", "TestReview6ATakeoverAfterARaiseHasAGreaterToken"},
	"restore (issue 38 review): a claim made before a restore writes again":                          {"./etcdstore", "TestReview6AClaimLostWithTheRestoreCannotSaveOverANewerOne"},
	"restore (issue 38 review): a late epoch answer is taken for a restore":                          {"./etcdstore", "TestReview6AnEpochRaiseSeenOutOfOrderIsNoRestore"},
	"proxy (issue 38 review): a takeover of an abandoned takeover of a dead claim forwards again":    {"./idemhttp", "TestATakeoverAfterAnAbandonedTakeoverOfADeadClaimDoesNotForward"},
	"records (issue 38 review): a takeover of a held claim does not say it was cut short":            {"./internal/kernel", "TestCutShortSurvivesFencesAndAbandons"},
	"records (issue 38 review): an abandon forgets that an earlier claim was cut short":              {"./internal/kernel", "TestCutShortSurvivesFencesAndAbandons"},
	"records (issue 38 review): the codec drops that an earlier claim was cut short":                 {"./idemhttp", "TestATakeoverAfterAnAbandonedTakeoverOfADeadClaimDoesNotForward"},
	"restore (issue 38): a running store takes no notice of etcd's revision going back":              {"./etcdstore", "TestARunningStoreRaisesTheEpochAfterARestore"},
	"restore (issue 38): a store starting on another cluster's data serves at once":                  {"./etcdstore", "TestAStoreStartingOnARestoredClusterRaisesTheEpoch"},
	"restore (issue 38): writes are sent while the epoch is not raised":                              {"./etcdstore", "TestAStoreThatCannotRaiseTheEpochRefusesToWrite"},
	"restore (issue 38): the write whose answer showed the restore is retried and won":               {"./etcdstore", "TestARunningStoreRaisesTheEpochAfterARestore"},
	"worker API (issue 38): a release retried after it landed is fenced":                             {"./api", "TestRetriedReleaseAndCompleteSucceed"},
	"claims (issue 38): a waiting claim gives up at the request timeout":                             {"./etcdstore", "TestWaitingClaimOutlastsTheRequestTimeout"},
	"worker API (issue 38): a text/plain body is taken":                                              {"./idemhttp", "TestWorkerAPIRefusesWhatABrowserSendsCrossSite"},
	"signals (issue 38): payloads are compared byte for byte":                                        {"./jobs", "TestASignalInAnotherJSONSpellingIsTheSameSignal"},
	"jobs (issue 38): a queue logs nothing unless given a logger":                                    {"./jobs", "TestJobsLogThroughTheProcesssLogger"},
	"worker API (issue 38): a body with a repeated member is taken":                                  {"./idemhttp", "TestWorkerAPIRefusesAmbiguousAndUnsendableInput"},
	"worker API (issue 38): an outcome's status is not checked":                                      {"./idemhttp", "TestWorkerAPIRefusesAmbiguousAndUnsendableInput"},
	"cli (issue 38): flags after the arguments are taken for arguments":                              {"./cmd/idem", "TestCLIBadInputExitsTwoAndSaysWhy"},
	"console (issue 38): parked jobs are listed in id order with the others":                         {"./cmd/idem", "TestConsoleShowsParkedJobsFirstAndAWaitsTimeout"},
	"console (issue 38): a signal's payload that is not JSON is sent":                                {"./cmd/idem", "TestConsoleShowsParkedJobsFirstAndAWaitsTimeout"},
	"console (issue 38): a schedule nobody runs shows upcoming occurrences":                          {"./cmd/idem", "TestASchedulesNobodyRunsShowsNoUpcomingOccurrences"},
	"cli (issue 38): a bytes flag that is not JSON is taken":                                         {"./cmd/idem", "TestCLIBadInputExitsTwoAndSaysWhy"},
	"shards (issue 37 review): a set lists by tenant, then id, not in etcd's key order":              {"./shard", "TestConformanceShards"},
	"shards (issue 37 review): a shard with a larger record limit keeps it":                          {"./shard", "TestReview5ConformanceShardsWithOptionsOfTheirOwn"},
	"cache (issue 37 review): a progress answer proves the cache current whatever its revision":      {"./etcdstore", "TestReview5CacheOnCutOffMemberReplaysPastItsBound"},
	"jobs (issue 37 review): a record written before kinds with a saved error is a failed job":       {"./jobs", "TestReview5LegacyFailedPlainKeyIsNotAJob"},
	"injector (issue 39): a pod that carries idem is injected again":                                 {"./internal/inject", "TestInjectsANativeSidecarInFrontOfTheAppsNamedPort"},
	"injector (issue 39): the app's port keeps its name, so the Service reaches the app, not idem":   {"./deploy", "TestSidecarInjectionOnARealControlPlane"},
	"injector (issue 39): idem is an ordinary init container, so the pod never starts":               {"./deploy", "TestSidecarInjectionOnARealControlPlane"},
	"injector (issue 39): a retention that is not whole seconds is taken":                            {"./internal/inject", "TestReview7SubSecondRetentionIsRefused"},
	"injector (issue 39): the app's probes keep naming the port idem took":                           {"./internal/inject", "TestInjectsANativeSidecarInFrontOfTheAppsNamedPort"},
	"chart (issue 39): the webhook sends every pod to the injector, not only labelled ones":          {"./deploy", "TestSidecarInjectionOnARealControlPlane"},
	"chart (issue 39): the webhook ignores a down injector":                                          {"./deploy", "TestSidecarInjectionOnARealControlPlane"},
	"chart (issue 39): idem's own namespace is injected":                                             {"./deploy", "TestSidecarInjectionOnARealControlPlane"},
	"chart (issue 39): pods run as root, which restricted Pod Security refuses":                      {"./deploy", "TestChartOnARealControlPlane"},
	"serve (issue 39): --tenant is ignored":                                                          {"./cmd/idem", "TestServeTenantFlag"},
	"injector (issue 39 review): an app port over UDP is taken":                                      {"./internal/inject", "TestReview7UDPAppPortIsRefused"},
	"injector (issue 39 review): the ports of init containers and sidecars are not checked":          {"./internal/inject", "TestReview7PortOfAnExistingSidecarIsInUse"},
	"injector (issue 39): the pod's grace period is left shorter than idem's shutdown":               {"./internal/inject", "TestInjectsANativeSidecarInFrontOfTheAppsNamedPort"},
	"shards (issue 39 review): a shard without TLS files ignores --cacert, --cert and --key":         {"./cmd/idem", "TestReview7ShardsSidecarUsesItsEtcdCertificate"},
	"injector (issue 39 review): a Windows pod gets idem's Linux sidecar":                            {"./internal/inject", "TestPodsIdemCannotServeAreRefused"},
	"serve (issue 39): --tenant puts jobs in the keys' tenant, where a key can claim a job's record": {"./cmd/idem", "TestServeTenantFlag"},
	"injector (issue 39 review 8): another container's port of the app port's name is allowed":       {"./internal/inject", "TestReview8ServiceOfASharedPortNameReachesIdem"},
	"injector (issue 39 review 8): a request above its limit is taken":                               {"./cmd/idem", "TestReview8InjectorRefusesResourcesTheAPIServerRefuses"},
	"injector (issue 39): an app port with a hostPort is taken":                                      {"./internal/inject", "TestBadAnnotationsAreRefusedNamingThem"},
	"work (issue 40): a report sent again is applied again":                                          {"./jobs", "TestAHubAnswersARepeatedReportAsBefore"},
	"work (issue 40): a silent worker fails its step":                                                {"./jobs", "TestAHubResumesAStepWhoseWorkerWentSilent"},
	"work (issue 40): a busy worker's attempt still waits for a worker":                              {"./jobs", "TestAHubGivesAWorkerThatJoinsAnotherJob"},
	"work (issue 40): a declared kind's limits are dropped":                                          {"./jobs", "TestAHubAppliesADeclaredLimit"},
	"work (issue 40): a report on an ended task is a conflict, which clients retry":                  {"./api", "TestWorkProtocolConformsToOpenAPI"},
	"work (issue 40): a sleep within a step goes on without waiting":                                 {"./jobs", "TestAHubRunsADeclaredKindThroughARemoteWorker"},
	"cli (issue 40): a kinds file is checked against the retention only by etcd":                     {"./cmd/idem", "TestJobsKindsCommand"},
	"python (issue 40): a lost reply is not retried":                                                 {"./cmd/idem", "TestClientsPython"},
	"typescript (issue 40): a lost reply is not retried":                                             {"./cmd/idem", "TestClientsTypeScript"},
	"work (issue 40 review): a worker of two kinds is counted on by both":                            {"./jobs", "TestReview9OneWorkerOfTwoKindsIsNotCountedTwice"},
	"work (issue 40 review): a new declaration ends the steps running":                               {"./jobs", "TestReview9DeclaringAnotherKindDoesNotEndARunningStep"},
	"work (issue 40 review): an await of no valid event is taken":                                    {"./jobs", "TestReview9ABadAwaitReportDoesNotFailTheJob"},
	"work (issue 40 review): next without wait_ms does not wait":                                     {"./api", "TestReview9NextWithoutWaitMSWaitsTheMaxWait"},
	"work (issue 40): a report that reaches another process is not relayed":                          {"./jobs", "TestAReportThatReachesAnotherProcessIsRelayed"},
	"schedules (issue 40): a declared kind's schedules are not run":                                  {"./jobs", "TestDeclaredSchedulesRunAndFollowTheirDeclarations"},
	"work (issue 40 review 2): a draining hub stops answering relayed reports":                       {"./jobs", "TestReview10ADrainingHubStillAnswersRelayedReports"},
	"work (issue 40 review 2): a relayed answer is left in etcd":                                     {"./jobs", "TestReview10RelayedAnswersOnUnknownTasksAreNotLeftForEver"},
	"schedules (issue 40 review 2): a schedule name is not checked against the tenant's other kinds": {"./jobs", "TestDeclaredSchedulesRunAndFollowTheirDeclarations"},
	"schedules (issue 40 review 2): one bad schedule stops the tenant's others":                      {"./jobs", "TestReview10AnUndeclaredKindsScheduleStops"},
	"python (issue 40 review 2): a refused report takes a number":                                    {"./cmd/idem", "TestClientsPython"},
	"typescript (issue 40 review 2): a refused report takes a number":                                {"./cmd/idem", "TestClientsTypeScript"},
}

// explorerKernel are the kernel's mutants measured by the explorer: the
// rules of a schedule's plan and of limits, an enqueue's guards and a
// release (the model checker has no schedulers, jobs or releases); a
// claim's shard-set compare, which the model shows is not what keeps a
// key on one shard in its world (every refusal reads the set with the
// record, and every later write compares the record: the explorer's
// invariant 22 holds the promise that every claim write carries it); and
// the epoch compare, which keeps tokens growing only across a restore of
// one shard while processes that knew its older epoch keep serving from it
// (the explorer's restores; the model's processes learn an epoch from
// every refused write, and its restores restart them).
var explorerKernel = map[string]bool{
	"schedules (defect 8): a scheduler ahead of the others skips occurrences for the fleet":   true,
	"schedules (issue 38): the outage rule judges lateness by one clock while the fleet runs": true,
	"epochs: a claim does not compare the shard epoch":                                        true,
	"limits: a rate slot is taken before its time has come":                                   true,
	"shards: an enqueue compares neither its shard's epoch nor its set":                       true,
	"deletes: a release deletes whatever the record is now":                                   true,
	"shards: a claim compares its shard's epoch and not its shard set":                        true,
	// The model's deadlines are shorter than its retentions; the
	// explorer's invariant 17 watches claims whose deadline is longer.
	"protocol: an in-flight record expires before its deadline": true,
}

var mutants = []mutant{
	// The claim protocol.
	// (Was: the owner read's answer ignored. The takeover's own compare,
	// that the owner key is gone, then refuses it: a claim answers
	// Conflict after eight refused rounds instead of one read. Now the
	// owner is neither read nor compared.)
	{"protocol: a live owner's claim is taken over", "internal/kernel/claim.go",
		"	default:\n		m.phase = claimOwner\n		return Action{Kind: ActOwner, Owner: cur.Owner}",
		"	default:\n		m.taken = cur"},
	{"protocol: a takeover does not compare the record it replaces", "internal/kernel/claim.go",
		"		cmps = append(cmps, Modified(m.req.Key, m.cur.Revision))",
		"		_ = Modified"},
	{"protocol: a deadline never makes a claim stale", "internal/kernel/claim.go",
		"	case cur.PastDeadline(now): // even our own: its holder may be gone",
		"	case false && cur.PastDeadline(now):"},
	{"protocol: a claim outlives its record's expiry", "etcdstore/claim.go",
		"	if !c.expires.IsZero() && (end.IsZero() || c.expires.Before(end)) {",
		"	if false && !c.expires.IsZero() && (end.IsZero() || c.expires.Before(end)) {"},
	{"protocol: an in-flight record expires before its deadline", "internal/kernel/record.go",
		"	if deadline.After(now) {\n		now = deadline\n	}",
		"	_ = deadline"},
	{"protocol: a claim's session loss does not cancel it", "etcdstore/store.go",
		"		for _, c := range lost {\n			c.cancel(ErrSessionLost)\n		}",
		"		_ = lost"},
	// Fencing.
	{"fencing: a claim's write does not compare its revision", "internal/kernel/write.go",
		"	m.txn = &Txn{If: []Cmp{Modified(m.h.Key, m.h.Rev)},",
		"	m.txn = &Txn{If: []Cmp{},"},
	// Recognising one's own writes.
	{"recognition: attempt ids compared on their first 8 bytes", "etcdstore/handle.go",
		"	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1",
		"	return len(a) >= 8 && len(b) >= 8 && subtle.ConstantTimeCompare([]byte(a[:8]), []byte(b[:8])) == 1"},
	{"recognition (defect 5): an empty header list is not its own outcome", "internal/kernel/record.go",
		"		headerIn(a.Header, b.Header) && headerIn(b.Header, a.Header)",
		"		len(a.Header) == len(b.Header) && headerIn(a.Header, b.Header) && headerIn(b.Header, a.Header)"},
	// Unknown outcomes and the reaper.
	{"reaper: abandons its attempt's claim whoever owns it", "internal/kernel/reap.go",
		"	case rec != nil && rec.State == InFlight && rec.Owner == owner && SameAttempt(rec.Attempt, attempt):",
		"	case rec != nil && rec.State == InFlight && SameAttempt(rec.Attempt, attempt):"},
	// (A WithoutSession claim is never reaped: reap does not start a
	// reaper for it, and a reaper's session check would end at once. Only
	// the first is a one-line bug; the second is its defence in depth.)
	{"reaper: a WithoutSession claim's unknown outcome starts a reaper", "etcdstore/do.go",
		"	if l.owner == deadlineOwner {\n		return\n	}\n	l.until",
		"	l.until"},
	// (Removing the pending case alone became an equivalent mutant once a
	// claim made by Run stayed registered while Run lasts: a pending claim
	// is always one. The bug is the supervisor forgetting it.)
	{"reaper (issue 29): a pending final write does not survive session loss", "etcdstore/store.go",
		"			case c.pending.Load():\n				kept++\n			case c.inRun:\n",
		"			case c.inRun && !c.pending.Load():\n"},
	{"reaper (issue 29): a finished work's outcome is not kept past its claim's deadline while it is saved", "etcdstore/do.go",
		"		c.pending.Store(true)\n	}\n	// Save even when",
		"		_ = 0\n	}\n	// Save even when"},
	{"recognition: a claim whose earlier try may have landed says its last try was not sent", "internal/kernel/claim.go",
		"	if m.uncertain && r.NotSent {",
		"	if false && m.uncertain && r.NotSent {"},
	{"reaper (review): a claim whose work runs is forgotten when its session is lost", "etcdstore/store.go",
		"			case c.inRun:\n",
		"			case false && c.inRun:\n"},
	{"recognition (review): a checkpoint whose earlier try may have landed says not sent", "internal/kernel/write.go",
		"	case r.MayHaveLanded:\n		m.maybe = true\n	case m.maybe && r.NotSent:\n		err = earlier(err) // this try never left, but an earlier one may have landed",
		"	case false:"},
	// Group commit.
	{"batching: a batch's lost reply is reported as not applied", "etcdstore/internal/send/send.go",
		"		for _, m := range batch {\n			answer(m, nil, err)\n		}",
		"		for _, m := range batch {\n			answer(m, nil, errors.Join(ErrNotSent, err))\n		}"},
	{"batching (defect 1): a caller that leaves while its write flies is told it was not sent", "etcdstore/internal/send/send.go",
		"			s.cfg.Clock.Wait(context.WithoutCancel(ctx), m.done)\n			s.mu.Lock()\n			continue",
		"			if s.cfg.Clock.Wait(ctx, m.done) != nil {\n				return nil, notSent(ctx)\n			}\n			s.mu.Lock()\n			continue"},
	// The sweeper.
	{"sweeper: deletes without its Lease == id guard", "internal/kernel/sweep.go",
		"&Txn{If: []Cmp{OnLease(k, lease)}, Then: []Op{Del(k)}}",
		"&Txn{Then: []Op{Del(k)}}"},
	// Dictionaries.
	{"dictionaries (defects 2, 3): a record compressed against a dictionary with no copy on its lease", "etcdstore/internal/dict/dict.go",
		"	key := d.copyKey(dict.id, l)\n	var resp *clientv3.TxnResponse\n	err := d.cfg.Send.Do(ctx, func(ctx context.Context) (err error) {",
		"	key := d.copyKey(dict.id, l)\n	var resp *clientv3.TxnResponse\n	err := d.cfg.Send.Do(ctx, func(ctx context.Context) (err error) {\n		if true {\n			resp = &clientv3.TxnResponse{}\n			return nil\n		}"},
	{"dictionaries: a copy whose write failed counts as made", "etcdstore/internal/dict/dict.go",
		"	e.ok = err == nil\n",
		"	e.ok = true\n"},
	// Epochs and restores.
	{"epochs (defect 4): a restore's epoch bump adds nothing", "etcdstore/epoch.go",
		"		next := cur + by\n",
		"		next := cur + 0*by\n"},
	// Close.
	{"close: the session is revoked before the final writes are flushed", "etcdstore/store.go",
		"	left := s.bg.close(ctx, s.endTimeout)",
		"	if s.sess != nil {\n		s.sess.CloseContext(ctx)\n	}\n	left := s.bg.close(ctx, s.endTimeout)"},
	{"close: Close does not wait for the pending final writes", "etcdstore/store.go",
		"	left := s.bg.close(ctx, s.endTimeout)",
		"	left := s.bg.close(ctx, 0)"},
	// Shards (issue 24).
	{"shards (defect 1): a change ends the hand-over before the drain", "shard/set.go",
		"	if h := s.handing(); h != nil && !p.equal(*h) {",
		"	if h := s.handing(); false && h != nil && !p.equal(*h) {"},
	{"shards (defect 2): a Moved record an older set left refuses claims on the key's home", "shard/route.go",
		"opts: []etcdstore.ClaimOption{storex.UnderShardSet(rev), storex.ReplaceMoved()}}, nil",
		"opts: []etcdstore.ClaimOption{storex.UnderShardSet(rev)}}, nil"},
	{"shards: a set's floor epoch is not raised on its shards", "shard/set.go",
		"				if storex.Epoch(st) <= set.Floor {",
		"				if false && storex.Epoch(st) <= set.Floor {"},
	{"shards: a claim on a key's old shard may create a record there", "shard/route.go",
		"opts: []etcdstore.ClaimOption{under, storex.WithoutCreate()}}, nil",
		"opts: []etcdstore.ClaimOption{under}}, nil"},
	// (A mutant that guarded the home's claim by max(routed, last read)
	// was nearly equivalent: ensure refuses a route when the shard holds
	// a newer set, so the two differed only if the store read one in the
	// few instructions between. This is the risk it stood for.)
	{"shards: a route is guarded by a newer set its shard holds instead of being refused", "shard/set.go",
		"			case there.same(set):\n",
		"			case there.same(set) || there.after(set):\n"},
	{"shards (review): a first set is installed while a shard does not answer", "shard/set.go",
		"				if st == nil {\n					return cur, fmt.Errorf(\"%w: no shard set in force is known",
		"				if st == nil {\n					names = slices.DeleteFunc(slices.Clone(names), func(x string) bool { return x == n })\n					continue\n					return cur, fmt.Errorf(\"%w: no shard set in force is known"},
	{"shards (review): the drain marks a shard without deleting its expired records", "shard/drain.go",
		"				stale = append(stale, rec)\n",
		"\n"},
	// Jobs and schedules (issue 24).
	{"jobs (defect 6): a last step whose ops were committed is failed for its end's size", "jobs/worker.go",
		"	if !ok && unsaved {",
		"	if !ok {"},
	{"jobs (review): a last step's ops commit although the job's end cannot fit", "jobs/worker.go",
		"w.q.maxRecord()); !ok {",
		"w.q.maxRecord()); false && !ok {"},
	{"schedules (defect 7): a cron schedule read by robfig/cron alone across daylight saving", "jobs/schedule.go",
		"			sp.Location = time.UTC // read on the wall clock, below\n			spec = zoned{spec: sp, loc: s.Location}",
		"			sp.Location = s.Location"},
	{"schedules (defect 8): a scheduler ahead of the others skips occurrences for the fleet", "internal/kernel/cursor.go",
		"	edge := now.Add(-r.Lateness - r.MaxSkew)\n",
		"	edge := now.Add(-r.Lateness)\n"},
	{"schedules (issue 38): the outage rule judges lateness by one clock while the fleet runs", "internal/kernel/cursor.go",
		"	if first := r.Next(from); !first.IsZero() && first.Before(edge) && stalled {",
		"	if first := r.Next(from); !first.IsZero() && (stalled || true) {"},
	{"schedules (review): a forgotten job's record is not deleted before the next occurrence", "jobs/schedule.go",
		"		rec, err := storex.Peek(&s.q.store.Admin, ctx, key)",
		"		rec, err := (*etcdstore.Record)(nil), etcdstore.ErrNotFound"},
	{"schedules (review): an occurrence the cursor says was submitted is submitted again once gone", "jobs/schedule.go",
		"		case cur.Submitted.Equal(prev):",
		"		case false && cur.Submitted.Equal(prev):"},
	// Limits.
	{"limits: a full limit's slots are taken without asking whether their holders' claims are over", "jobs/limit.go",
		"				if !ok {\n					p.Stale = append(p.Stale, o)",
		"				if !ok || true {\n					p.Stale = append(p.Stale, o)"},
	{"limits: a rate slot is taken before its time has come", "internal/kernel/slots.go",
		"		if s.Until > now.UnixMilli() {",
		"		if false && s.Until > now.UnixMilli() {"},
	// The replay cache.
	{"cache: serves entries however stale", "etcdstore/internal/cache/cache.go",
		"	fresh := c.fresh()\n	c.mu.Lock()",
		"	fresh := true\n	c.mu.Lock()"},
	{"cache: an eviction leaves the record in the evicting store's cache", "etcdstore/store.go",
		"	if gone && s.cache != nil {",
		"	if false && gone && s.cache != nil {"},
}

// The kernel's own mutants, beyond those of the list above whose code
// moved into it: each a promise the kernel keeps that the model checker's
// invariants watch.
var kernelMutants = []mutant{
	{name: "reaper (model checker): a fence conflicting with its own session's record ends the reaper", file: "internal/kernel/reap.go",
		old: "		case r == nil, a.Verdict == Conflict && r.Owner == owner && r.Revision <= seen, r.Expired(until):",
		new: "		case r == nil, r.Expired(until):"},
	{name: "reaper: an absent key needs no fence", file: "internal/kernel/reap.go",
		old: "	case rec == nil || rec.Expired(now) || (rec.State == InFlight || rec.State == Moved) && rec.Revision <= seen:\n		return ReapFence",
		new: "	case rec == nil:\n		return ReapDone\n	case rec.Expired(now) || (rec.State == InFlight || rec.State == Moved) && rec.Revision <= seen:\n		return ReapFence"},
	{name: "reaper (model checker): a guard that expires before the lost writes can land is enough", file: "internal/kernel/reap.go",
		old: "	case !rec.Expired(until):", new: "	case !rec.Expired(now):"},
	{name: "reaper (model checker): a claim's reads do not count as seen by its reaper", file: "internal/kernel/claim.go",
		old: "	m.seen = max(m.seen, rev)\n	if m.phase == claimFull {", new: "	if m.phase == claimFull {"},
	{name: "protocol: a claim is written under a session that has ended", file: "internal/kernel/claim.go",
		old: "		cmps = append(cmps, Exists(k.Owner(m.req.Owner)))", new: "		_ = Exists"},
	{name: "protocol: an attempt this process holds is taken over as an orphan", file: "internal/kernel/claim.go",
		old: "	return cur != nil && cur.Owner != \"\" && !SameAttempt(cur.Attempt, m.req.Attempt) && v.heldHere(cur.Attempt)",
		new: "	return false && cur != nil && cur.Owner != \"\" && !SameAttempt(cur.Attempt, m.req.Attempt) && v.heldHere(cur.Attempt)"},
	{name: "fencing: an in-flight write past its record's expiry is sent", file: "internal/kernel/write.go",
		old: "	if w := m.want; w != nil && w.State == InFlight && !m.h.Expires.IsZero() && !v.Now.Before(m.h.Expires) {",
		new: "	if w := m.want; false && w != nil && w.State == InFlight && !m.h.Expires.IsZero() && !v.Now.Before(m.h.Expires) {"},
	{name: "recognition: a write that finds its own earlier write landed takes itself for fenced", file: "internal/kernel/write.go",
		old: "	case mine && cur.State == InFlight:", new: "	case false && mine && cur.State == InFlight:"},
	{name: "epochs: a claim does not compare the shard epoch", file: "internal/kernel/guards.go",
		old: "	return append(cmps, c.Keys.Guards(v.Epoch, rev)...), guarded{on: true, epoch: v.Epoch, setRev: rev}",
		new: "	return append(cmps, c.Keys.SetCmp(rev)), guarded{on: true, epoch: v.Epoch, setRev: rev}"},
	{name: "epochs: a refused claim does not learn the shard's epoch", file: "internal/kernel/guards.go",
		old: "		n.Epoch, n.NewEpoch = r.Epoch, true", new: "		n.Epoch = r.Epoch"},
	{name: "shards: a claim compares its shard's epoch and not its shard set", file: "internal/kernel/guards.go",
		old: "	return append(cmps, c.Keys.Guards(v.Epoch, rev)...), guarded{on: true, epoch: v.Epoch, setRev: rev}",
		new: "	return append(cmps, c.Keys.EpochCmp(v.Epoch)), guarded{on: true, epoch: v.Epoch, setRev: rev}"},
	{name: "shards: an enqueue compares neither its shard's epoch nor its set", file: "internal/kernel/enqueue.go",
		old: "	cmps, m.sentG = m.cfg.guard(cmps, v, m.req.SetRev)",
		new: "	_, m.sentG = m.cfg.guard(cmps, v, m.req.SetRev)"},
	{name: "deletes: a release deletes whatever the record is now", file: "internal/kernel/write.go",
		old: "	m.txn = &Txn{If: []Cmp{Modified(m.h.Key, m.h.Rev)}, Then: []Op{then}, Else: []Op{Read(m.h.Key)}}",
		new: "	m.txn = &Txn{If: []Cmp{Modified(m.h.Key, m.h.Rev)}, Then: []Op{then}, Else: []Op{Read(m.h.Key)}}\n	if m.want == nil {\n		m.txn.If = nil\n	}"},
	{name: "sweeper: a bucket is due before its retention has passed", file: "internal/kernel/sweep.go",
		old: "	return !now.Before(end.Add(retention + margin))", new: "	return !now.Before(end.Add(margin))"},
	{name: "EvictIf: deletes whatever the record is now", file: "internal/kernel/sweep.go",
		old: "	return &Txn{If: []Cmp{Modified(key, rev)}, Then: []Op{Del(key)}, Else: []Op{CountOf(key)}}",
		new: "	return &Txn{Then: []Op{Del(key)}, Else: []Op{CountOf(key)}}"},
	{name: "schedules: a job's record is forgotten before its retention passed", file: "internal/kernel/cursor.go",
		old: "	case now.Before(rec.Expires):", new: "	case now.Before(rec.Expires.Add(-time.Second)):"},
	{name: "cache: a read without a write replays an expired record", file: "internal/kernel/sweep.go",
		old: "	case rec == nil || rec.Expired(now) || rec.State != Done:", new: "	case rec == nil || rec.State != Done:"},
	{name: "reaper: a Moved record the lost claim saw needs no fence", file: "internal/kernel/reap.go",
		old: "(rec.State == InFlight || rec.State == Moved) && rec.Revision <= seen", new: "rec.State == InFlight && rec.Revision <= seen"},
	{name: "enqueue: a refusal by the shard epoch is taken for the value's moving", file: "internal/kernel/enqueue.go",
		old: "	if m.req.Value != \"\" && !n.NewEpoch && (", new: "	if m.req.Value != \"\" && ("},
	{name: "claim (review): while etcd is full, our own landed claim is won without asking whether its session lives", file: "internal/kernel/claim.go",
		old: "		if cur.Owner == DeadlineOwner {\n			return m.end(Answer{Verdict: Won, Record: cur})", new: "		if true {\n			return m.end(Answer{Verdict: Won, Record: cur})"},
	{name: "store (issue 37): a replay is read serializably, so a lagging member replays deleted records", file: "etcdstore/acquire.go",
		old: "	resp, err := s.client.Get(rctx, s.ks.record(k))\n", new: "	resp, err := s.client.Get(rctx, s.ks.record(k), clientv3.WithSerializable())\n"},
	{name: "shards (issue 37): EvictIf of a key no shard holds fails with not found", file: "shard/jobs.go",
		old: "	if errors.Is(err, etcdstore.ErrNotFound) {\n		return true, nil\n	}\n", new: ""},
	{name: "records (issue 37): a takeover forgets what the record is", file: "internal/kernel/claim.go",
		old: "t.Takeovers+1, t.Kind", new: "t.Takeovers+1, KindKey"},
	{name: "records (issue 37): a claim's write forgets what the record is", file: "internal/kernel/write.go",
		old: "CutShort: h.CutShort, Kind: h.Kind,", new: "CutShort: h.CutShort,"},
	{name: "jobs (issue 37): a plain key whose work failed is read as a failed job", file: "jobs/state.go",
		old: "	if rec.Kind == etcdstore.KindKey {", new: "	if false {"},
	{name: "proxy (issue 38): a takeover of a dead idem's claim forwards the request again", file: "idemhttp/middleware.go",
		old: "	if !c.TookOver() || !c.CutShort() {", new: "	if true || !c.TookOver() || !c.CutShort() {"},
	{name: "limits (issue 38): a Key function's panic is not recovered", file: "jobs/limit.go",
		old: "			err = fmt.Errorf(\"its Key function panicked: %v\", v)", new: "			panic(v)"},
	{name: "schedules (issue 38): a Params function's panic is not recovered", file: "jobs/schedule.go",
		old: "				err = fmt.Errorf(\"%w: schedule %s: its Params function panicked", new: "				panic(v)\n				err = fmt.Errorf(\"%w: schedule %s: its Params function panicked"},
	{name: "console (issue 38): a schedule nobody runs shows upcoming occurrences", file: "cmd/idem/jobs.go",
		old: "	return next[0].Before(now.Add(-2*next[1].Sub(next[0]) - 5*time.Minute))", new: "	return false"},
	{name: "console (issue 38): a signal's payload that is not JSON is sent", file: "cmd/idem/console.go",
		old: "		if payload != \"\" && !json.Valid([]byte(payload)) {", new: "		if payload != \"\" && !json.Valid([]byte(payload)) && false {"},
	{name: "console (issue 38): parked jobs are listed in id order with the others", file: "cmd/idem/console.go",
		old: "return parkedFirst(a) - parkedFirst(b) })", new: "return 0 * (parkedFirst(a) - parkedFirst(b)) })"},
	{name: "cli (issue 38): flags after the arguments are taken for arguments", file: "cmd/idem/flags.go",
		old: "		for i < len(rest) && (rest[i] == \"-\" || !strings.HasPrefix(rest[i], \"-\")) {", new: "		for i < len(rest) {"},
	{name: "cli (issue 38): a bytes flag that is not JSON is taken", file: "cmd/idem/jobs.go",
		old: "	case inline != \"\" && !json.Valid([]byte(inline)):", new: "	case inline != \"\" && !json.Valid([]byte(inline)) && false:"},
	{name: "worker API (issue 38): a body with a repeated member is taken", file: "idemhttp/api.go",
		old: "	if _, err := canonjson.Canonical(body); err != nil && json.Valid(body) {", new: "	if _, err := canonjson.Canonical(body); err != nil && json.Valid(body) && false {"},
	{name: "worker API (issue 38): an outcome's status is not checked", file: "idemhttp/api_handlers.go",
		old: "	if o.Status != 0 && (o.Status < 100 || o.Status > 599) {", new: "	if o.Status < 0 && o.Status > 599 {"},
	{name: "jobs (issue 38): a queue logs nothing unless given a logger", file: "jobs/queue.go",
		old: "log: slog.Default(), clock: store.Clock(),", new: "log: slog.New(slog.DiscardHandler), clock: store.Clock(),"},
	{name: "signals (issue 38): payloads are compared byte for byte", file: "jobs/signal.go",
		old: "	return errA == nil && errB == nil && fa == fb", new: "	return errA == nil && errB == nil && fa == fb && false"},
	{name: "worker API (issue 38): a text/plain body is taken", file: "idemhttp/api.go",
		old: "		if err != nil || mt != \"application/json\" && !strings.HasSuffix(mt, \"+json\") {", new: "		if err != nil || mt == \"\" && !strings.HasSuffix(mt, \"+json\") {"},
	{name: "claims (issue 38): a waiting claim gives up at the request timeout", file: "etcdstore/claim.go",
		old: "	if !cfg.wait {\n		ctx, cancel = s.bound(ctx)", new: "	if true {\n		ctx, cancel = s.bound(ctx)"},
	{name: "worker API (issue 38): a release retried after it landed is fenced", file: "idemhttp/api_handlers.go",
		old: "		return rec == nil || rec.State == etcdstore.InFlight && rec.Owner == \"\"", new: "		return rec != nil && rec.State == etcdstore.InFlight && rec.Owner == \"\""},
	{name: "schedules (issue 38): after an outage the skew window runs MaxSkew's occurrences at once", file: "internal/kernel/cursor.go",
		old: "		p.AfterOutage, edge = true, now.Add(-r.Lateness)", new: "		p.AfterOutage = true"},
	{name: "explorer (issue 38): a Key function's panic is not recovered (the explorer's poisoned job)", file: "jobs/limit.go",
		old: "			err = fmt.Errorf(\"its Key function panicked: %v\", v)", new: "			panic(v)"},
	{name: "explorer (issue 38): signal payloads compared byte for byte (the explorer's W6)", file: "jobs/signal.go",
		old: "	return errA == nil && errB == nil && fa == fb", new: "	return errA == nil && errB == nil && fa == fb && false"},
	{name: "explorer (issue 38): a takeover of a dead idem's claim forwards again (the explorer's 2b)", file: "idemhttp/middleware.go",
		old: "	if !c.TookOver() || !c.CutShort() {", new: "	if true || !c.TookOver() || !c.CutShort() {"},
	{name: "proxy (issue 38 review): a takeover of an abandoned takeover of a dead claim forwards again", file: "idemhttp/middleware.go",
		old: "	if !c.TookOver() || !c.CutShort() {", new: "	if prev := c.Previous(); !c.TookOver() || prev == nil || prev.Owner == \"\" {"},
	{name: "records (issue 38 review): a takeover of a held claim does not say it was cut short", file: "internal/kernel/claim.go",
		old: `		rec.CutShort = t.CutShort || t.Owner != ""`, new: `		rec.CutShort = t.CutShort`},
	{name: "records (issue 38 review): an abandon forgets that an earlier claim was cut short", file: "internal/kernel/write.go",
		old: "Takeovers: h.Takeovers, CutShort: h.CutShort, Kind: h.Kind,", new: "Takeovers: h.Takeovers, Kind: h.Kind,"},
	{name: "records (issue 38 review): the codec drops that an earlier claim was cut short", file: "etcdstore/codec.go",
		old: "	case fCutShort:\n		r.CutShort = v == 1", new: "	case fCutShort:"},
	{name: "restore (issue 38): a running store takes no notice of etcd's revision going back", file: "etcdstore/restore.go",
		old: "(c == 0 || c == h.ClusterId) && h.Revision >= floor {", new: "(c == 0 || c == h.ClusterId) {"},
	{name: "restore (issue 38): a store starting on another cluster's data serves at once", file: "etcdstore/restore.go",
		old: "	if cv.ClusterID == id {", new: "	if cv.ClusterID == id || true {"},
	{name: "restore (issue 38): writes are sent while the epoch is not raised", file: "etcdstore/kernel.go",
		old: "	if err := s.refusal(); err != nil {", new: "	if err := s.refusal(); err != nil && false {"},
	{name: "restore (issue 38): the write whose answer showed the restore is retried and won", file: "etcdstore/kernel.go",
		old: "			(!errors.Is(err, ErrRestored) || errors.Is(err, ErrNotSent))}", new: "			(errors.Is(err, ErrRestored) || !errors.Is(err, ErrNotSent))}"},
	{name: "schedules (issue 38 review): an outage is judged by the first occurrence alone", file: "internal/kernel/cursor.go",
		old: "	stalled := !written.IsZero() && written.Before(now.Add(-r.Lateness-2*r.MaxSkew))", new: "	stalled := true"},
	{name: "schedules (issue 38 review): a scheduler moving the cursor does not say when", file: "jobs/schedule.go",
		old: "		cv.Last, cv.At = last.UTC(), s.q.clock.Now().UTC()", new: "		cv.Last = last.UTC()"},
	{name: "restore (issue 38 review): a detector raises only when revisions say so", file: "etcdstore/restore.go",
		old: "		if force || cur <= believed {", new: "		if force {"},
	{name: "restore (issue 38 review): a plain store's claims do not compare the epoch", file: "etcdstore/kernel.go",
		old: "Epochs: s.epochs, EpochGuard: true}", new: "Epochs: s.epochs}"},
	{name: "restore (issue 38 review): a claim made before a restore writes again", file: "etcdstore/write.go",
		old: "	if c.gen != c.s.restores.Load() {", new: "	if false {"},
	{name: "restore (issue 38 review): a late epoch answer is taken for a restore", file: "etcdstore/kernel.go",
		old: "			if n.Rev > s.epochAt.Load() {", new: "			if true {"},
	{name: "fresh machine (issue 38): the README's test command installs nothing", file: "scripts/test",
		old: "\nscripts/test-deps\n", new: "\n"},
	{name: "schedules (issue 38): a new schedule's cursor starts MaxSkew back", file: "jobs/schedule.go",
		old: "	cv = cursorValue{Last: now.UTC().Truncate(time.Second), At: now.UTC()}", new: "	cv = cursorValue{Last: now.Add(-sc.MaxSkew).UTC().Truncate(time.Second), At: now.UTC()}"},
	{name: "jobs (issue 38): a step declared to wait past the retention is registered", file: "jobs/kind.go",
		old: "		if s.waits >= retention/2 {", new: "		if s.waits >= retention*2 {"},
	{name: "grpc (issue 38): a takeover of a dead server's claim runs the handler again", file: "idemgrpc/server.go",
		old: "		if c.TookOver() && c.CutShort() && i.cfg.OnUnknownOutcome", new: "		if false && c.TookOver() && c.CutShort() && i.cfg.OnUnknownOutcome"},
	{name: "shards (issue 37 review): a set lists by tenant, then id, not in etcd's key order", file: "shard/admin.go",
		old: "return listOrder(out[i].Key) < listOrder(out[j].Key)", new: "return out[i].Key.Tenant < out[j].Key.Tenant || out[i].Key.Tenant == out[j].Key.Tenant && out[i].Key.ID < out[j].Key.ID"},
	{name: "shards (issue 37 review): a shard with a larger record limit keeps it", file: "shard/shard.go",
		old: "	opts = append(opts, etcdstore.WithMaxRecordSize(s.Settings().MaxRecordSize))\n", new: ""},
	{name: "cache (issue 37 review): a progress answer proves the cache current whatever its revision", file: "etcdstore/internal/cache/cache.go",
		old: "		rev, err := c.revision(ctx)\n", new: "		rev, err := int64(0), ctx.Err()\n"},
	{name: "jobs (issue 37 review): a record written before kinds with a saved error is a failed job", file: "jobs/state.go",
		old: "(rec.Kind == etcdstore.KindJob || strings.HasPrefix(rec.Outcome.Err, storex.OutcomeNotSaved))", new: "(strings.HasPrefix(rec.Outcome.Err, storex.OutcomeNotSaved) || true)"},
	{name: "docs (issue 37): JOBS.md says a job's claim is two Txns", file: "docs/JOBS.md",
		old: "  | an attempt's claim of a queued job | 1 | 1 |", new: "  | an attempt's claim of a queued job | 2 | 0 |"},
	{name: "jobs (issue 37): a claim that replays an ended job counts as a run", file: "jobs/worker.go",
		old: "	if err == nil && res.Replayed {", new: "	if err == nil && res.Replayed && false {"},
	{name: "reaper (review): a fence over a Moved record compares the reaper's shard set, not the lost claim's", file: "internal/kernel/reap.go",
		old: "	if overMoved {\n		return lost\n	}\n	return own", new: "	return own"},
	{name: "injector (issue 39): a pod that carries idem is injected again", file: "internal/inject/inject.go",
		old: "if _, ok := anns[AnnInjected]; ok || hasContainer(spec, ContainerName) {", new: "if false {"},
	{name: "injector (issue 39): the app's port keeps its name, so the Service reaches the app, not idem", file: "internal/inject/inject.go",
		old: "\t\tif pm, _ := p.(obj); pm[\"name\"] == name {\n\t\t\tdelete(pm, \"name\")\n\t\t}", new: "\t\t_ = p"},
	{name: "injector (issue 39): idem is an ordinary init container, so the pod never starts", file: "internal/inject/inject.go",
		old: "\t\tct[\"restartPolicy\"] = \"Always\"\n", new: ""},
	{name: "injector (issue 39): a retention that is not whole seconds is taken", file: "internal/inject/inject.go",
		old: "if err != nil || d < time.Second || d%time.Second != 0 {", new: "if err != nil {"},
	{name: "injector (issue 39): the app's probes keep naming the port idem took", file: "internal/inject/inject.go",
		old: "\t\t\tif a, _ := hm[k].(obj); a != nil && a[\"port\"] == name {", new: "\t\t\tif a, _ := hm[k].(obj); a != nil && a[\"port\"] == name && false {"},
	{name: "chart (issue 39): the webhook sends every pod to the injector, not only labelled ones", file: "deploy/helm/idem/templates/injector.yaml",
		old: "    objectSelector:\n      matchLabels:\n        idem.dev/inject: \"true\"\n", new: ""},
	{name: "chart (issue 39): the webhook ignores a down injector", file: "deploy/helm/idem/templates/injector.yaml",
		old: "failurePolicy: {{ .Values.injector.failurePolicy }}", new: "failurePolicy: Ignore"},
	{name: "chart (issue 39): idem's own namespace is injected", file: "deploy/helm/idem/templates/injector.yaml",
		old: "          values: [{{ $ns | quote }}, \"kube-system\"]", new: "          values: [\"kube-system\"]"},
	{name: "chart (issue 39): pods run as root, which restricted Pod Security refuses", file: "deploy/helm/idem/templates/_helpers.tpl",
		old: "runAsNonRoot: true", new: "runAsNonRoot: false"},
	{name: "serve (issue 39): --tenant is ignored", file: "cmd/idem/serve.go",
		old: "tenant := idemhttp.FixedTenant(c.fixedTenant)", new: "tenant := idemhttp.FixedTenant(etcdstore.DefaultTenant)"},
	{name: "injector (issue 39 review): an app port over UDP is taken", file: "internal/inject/inject.go",
		old: "\t\t\tif ports[i].proto != \"TCP\" {", new: "\t\t\tif false {"},
	{name: "injector (issue 39 review): the ports of init containers and sidecars are not checked", file: "internal/inject/inject.go",
		old: "\tfor _, p := range all {\n\t\tif p.num == s.port", new: "\tfor _, p := range ports {\n\t\tif p.num == s.port"},
	{name: "injector (issue 39): the pod's grace period is left shorter than idem's shutdown", file: "internal/inject/inject.go",
		old: "\tif int64(grace) < need {", new: "\tif int64(grace) < need && false {"},
	{name: "shards (issue 39 review): a shard without TLS files ignores --cacert, --cert and --key", file: "cmd/idem/shards.go",
		old: "\t\t\te.cacert, e.cert, e.key = base.cacert, base.cert, base.key", new: "\t\t\t_ = base"},
	{name: "injector (issue 39 review): a Windows pod gets idem's Linux sidecar", file: "internal/inject/inject.go",
		old: "podOS[\"name\"] != nil && podOS[\"name\"] != \"linux\" {", new: "podOS[\"name\"] != nil && podOS[\"name\"] == \"none\" {"},
	{name: "serve (issue 39): --tenant puts jobs in the keys' tenant, where a key can claim a job's record", file: "cmd/idem/server.go",
		old: "if c.tlsClientCAFile != \"\" || c.tokens != nil || c.tenantHeader != \"\" {", new: "if c.tlsClientCAFile != \"\" || c.tokens != nil || c.tenantHeader != \"\" || c.fixedTenant != etcdstore.DefaultTenant {"},
	{name: "injector (issue 39 review 8): another container's port of the app port's name is allowed", file: "internal/inject/inject.go",
		old: "\t\t\tif p.name == s.portName && p.in != s.appIn {", new: "\t\t\tif p.name == s.portName && p.in != s.appIn && false {"},
	{name: "injector (issue 39 review 8): a request above its limit is taken", file: "internal/inject/inject.go",
		old: "quantityValue(q) > quantityValue(l) {", new: "quantityValue(q) > quantityValue(l) && false {"},
	{name: "injector (issue 39): an app port with a hostPort is taken", file: "internal/inject/inject.go",
		old: "\t\t\tif ports[i].host != 0 {", new: "\t\t\tif ports[i].host != 0 && false {"},
	{name: "work (issue 40): a report sent again is applied again", file: "jobs/hub.go",
		old: "	if p := t.answers[rep.Seq]; p != nil && rep.Op != \"renew\" {", new: "	if p := t.answers[rep.Seq]; p != nil && rep.Op == \"none\" {"},
	{name: "work (issue 40): a silent worker fails its step", file: "jobs/worker.go",
		old: "	case errors.Is(err, errWorkerLost):\n		return etcdstore.Outcome{}, etcdstore.EndAbandon, true\n", new: ""},
	{name: "work (issue 40): a busy worker's attempt still waits for a worker", file: "jobs/hub.go",
		old: "	if nfree <= h.held[kind]-h.busy[kind]-counted {", new: "	if nfree <= h.held[kind]-counted {"},
	{name: "work (issue 40): a declared kind's limits are dropped", file: "jobs/declare.go",
		old: "		k.Limits = append(k.Limits, Limit{", new: "		_ = append(k.Limits, Limit{"},
	{name: "work (issue 40): a report on an ended task is a conflict, which clients retry", file: "idemhttp/problem.go",
		old: "		return NewProblem(http.StatusGone, KindTaskGone,", new: "		return NewProblem(http.StatusConflict, KindConflict,"},
	{name: "work (issue 40): a sleep within a step goes on without waiting", file: "jobs/hub.go",
		old: "		case errors.Is(err, ErrSuspended):\n			a.Result, end = \"suspended\", true\n		default:\n			a.Result, a.Error, end = \"failed\", err.Error(), true\n		}\n	case \"await\":", new: "		case errors.Is(err, ErrSuspended):\n			a.Result, err = \"continue\", nil\n		default:\n			a.Result, a.Error, end = \"failed\", err.Error(), true\n		}\n	case \"await\":"},
	{name: "cli (issue 40): a kinds file is checked against the retention only by etcd", file: "cmd/idem/jobs_kinds.go",
		old: "			if err := d.Check(*retention); err != nil {", new: "			if err := d.Check(1 << 62); err != nil {"},
	{name: "python (issue 40): a lost reply is not retried", file: "clients/python/idem/client.py",
		old: "                if time.monotonic() + delay > deadline:", new: "                if True:"},
	{name: "typescript (issue 40): a lost reply is not retried", file: "clients/typescript/src/index.ts",
		old: "        if (Date.now() + delay > deadline) throw", new: "        if (true) throw"},
	{name: "work (issue 40 review): a worker of two kinds is counted on by both", file: "jobs/hub.go",
		old: "		case p.resv == \"\" && slices.Contains(p.kinds, kind):", new: "		case slices.Contains(p.kinds, kind):"},
	{name: "work (issue 40 review): a new declaration ends the steps running", file: "jobs/hub.go",
		old: "			old.closeWhenIdle()\n", new: "			old.Close()\n"},
	{name: "work (issue 40 review): an await of no valid event is taken", file: "jobs/hub.go",
		old: "		if err := validName(rep.Event, 64, true); err != nil {", new: "		if err := validName(rep.Event, 64, true); err != nil && false {"},
	{name: "work (issue 40 review): next without wait_ms does not wait", file: "idemhttp/api_work.go",
		old: "	if req.WaitMS > 0 {\n		wait = min(", new: "	if true {\n		wait = min("},
	{name: "work (issue 40 review 2): a draining hub stops answering relayed reports", file: "jobs/hub.go",
		old: "func (h *Hub) Close() error {\n	h.mu.Lock()", new: "func (h *Hub) Close() error {\n	h.stop()\n	<-h.relays\n	h.mu.Lock()"},
	{name: "work (issue 40 review 2): a relayed answer is left in etcd", file: "jobs/relay.go",
		old: "		_, _ = storex.DeleteValue(h.q.store, dctx, av.Name, av.Revision)", new: "		_ = av"},
	{name: "schedules (issue 40 review 2): a schedule name is not checked against the tenant's other kinds", file: "jobs/declare.go",
		old: "				if o.Name != d.Name && slices.ContainsFunc(", new: "				if false && slices.ContainsFunc("},
	{name: "schedules (issue 40 review 2): one bad schedule stops the tenant's others", file: "jobs/declared_schedules.go",
		old: "		for _, err := range errs {\n", new: "		for _, err := range errs {\n			scs = nil\n"},
	{name: "python (issue 40 review 2): a refused report takes a number", file: "clients/python/idem/worker.py",
		old: "            # Refused (a 400 changes nothing, and takes no number), or gone.\n", new: "            self._seq = max(self._seq, seq)\n"},
	{name: "typescript (issue 40 review 2): a refused report takes a number", file: "clients/typescript/src/index.ts",
		old: "      // Refused (a 400 changes nothing, and takes no number), or gone.\n", new: "      if (op !== \"renew\") this.seq = Math.max(this.seq, seq);\n"},
	{name: "schedules (issue 40): a declared kind's schedules are not run", file: "jobs/declared_schedules.go",
		old: "		if len(decl.Schedules) > 0 {", new: "		if len(decl.Schedules) > 0 && false {"},
	{name: "work (issue 40): a report that reaches another process is not relayed", file: "jobs/relay.go",
		old: "	if hub == \"\" || hub == h.id || h.q.store == nil {", new: "	if true {"},
}

func main() {
	budget := flag.Duration("budget", 11*time.Minute, "the explorer's budget per mutant (scripts/test's CI budget by default)")
	modelBudget := flag.Duration("model-budget", time.Minute, "the model checker's budget per kernel mutant")
	only := flag.String("only", "", "run only the mutants whose name matches this regular expression")
	check := flag.Bool("check", false, "check that every mutant applies, and exit")
	onlyModel := flag.Bool("model", false, "run only the kernel's mutants (the model checker's)")
	onlyExplorer := flag.Bool("explorer", false, "run only the mutants outside the kernel (the explorer's)")
	list := flag.Bool("list", false, "list the mutants and exit")
	onlyBackstops := flag.Bool("backstops", false, "run only the backstop tests of the mutants that have one, not the explorer")
	flag.Parse()
	if *list {
		for _, m := range all() {
			fmt.Printf("%s  (%s, %s)\n", m.name, m.file, m.oracle())
		}
		return
	}
	if err := os.Chdir(root()); err != nil {
		fatal(err)
	}
	// Check every mutant applies before running any.
	var run []mutant
	re, err := regexp.Compile(*only)
	if err != nil {
		fatal(fmt.Errorf("-only: %w", err))
	}
	for _, m := range all() {
		_, hasBackstop := backstops[m.name]
		if !*check && (!re.MatchString(m.name) || *onlyModel && !m.model() || *onlyExplorer && m.model() || *onlyBackstops && !hasBackstop) {
			continue
		}
		src, err := os.ReadFile(m.file)
		if err != nil {
			fatal(err)
		}
		if n := bytes.Count(src, []byte(m.old)); n != 1 {
			fatal(fmt.Errorf("mutant %q: its text occurs %d times in %s, not once: update it", m.name, n, m.file))
		}
		run = append(run, m)
	}
	if *check {
		fmt.Printf("%d mutants, each applies once\n", len(run))
		return
	}
	killed, byBackstop := 0, 0
	fmt.Printf("%d mutants, explorer budget %v each, model checker budget %v each\n\n", len(run), *budget, *modelBudget)
	for i, m := range run {
		fmt.Printf("[%d/%d] %s (%s)\n", i+1, len(run), m.name, m.oracle())
		b := *budget
		if m.model() {
			b = *modelBudget
		}
		var r result
		if bs, ok := contract[m.name]; ok {
			r = applyBackstop(m, bs)
			fmt.Printf("    %s: %s\n", bs.test, r)
		} else if !*onlyBackstops {
			r = apply(m, b)
			fmt.Printf("    %s\n", r)
		}
		if bs, ok := backstops[m.name]; ok && !r.killed {
			r = applyBackstop(m, bs)
			if !r.killed && r.why == "" {
				fmt.Printf("    backstop %s: passed: survived (%s)\n", bs.test, r.took)
			} else {
				fmt.Printf("    backstop %s: %s\n", bs.test, r)
			}
			if r.killed {
				byBackstop++
			}
		}
		if r.killed {
			killed++
		}
	}
	fmt.Printf("\nkilled %d of %d mutants (%.0f%%), %d of them by a backstop test\n", killed, len(run), 100*float64(killed)/float64(max(1, len(run))), byBackstop)
	if killed < len(run) {
		os.Exit(1)
	}
}

type result struct {
	killed    bool
	schedules string // how many schedules ran
	took      string // the explorer's time
	why       string // the first violation, or why the run did not count
}

func (r result) String() string {
	if r.killed && strings.HasSuffix(r.schedules, "states") {
		return fmt.Sprintf("KILLED after %s in %s: %s", r.schedules, r.took, r.why)
	}
	if r.killed && r.schedules == "" {
		return fmt.Sprintf("KILLED in %s: %s", r.took, r.why)
	}
	if r.killed {
		return fmt.Sprintf("KILLED after %s schedules in %s: %s", r.schedules, r.took, r.why)
	}
	if r.why != "" {
		return "NOT RUN: " + r.why
	}
	if strings.HasSuffix(r.schedules, "states") {
		return fmt.Sprintf("survived %s in %s", r.schedules, r.took)
	}
	return fmt.Sprintf("survived %s schedules in %s", r.schedules, r.took)
}

var (
	countRe = regexp.MustCompile(`(\d+) schedules in (\S+?)[ :(]`)
	seedRe  = regexp.MustCompile(`seed \d+: (.*)`)
)

// apply runs m's oracle (the explorer, the model checker or the decision
// table) on it.
func apply(m mutant, budget time.Duration) result {
	return withMutant(m, func() result {
		if m.model() {
			return model(budget)
		}
		if tableKernel[m.name] {
			return table()
		}
		return explore(budget)
	})
}

// withMutant applies m, builds, runs oracle, and restores m's file however
// it ends.
func withMutant(m mutant, oracle func() result) result {
	orig, err := os.ReadFile(m.file)
	if err != nil {
		fatal(err)
	}
	restore := func() {
		if err := os.WriteFile(m.file, orig, 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "mutate: RESTORE %s BY HAND: %v\n", m.file, err)
		}
	}
	defer restore()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sig)
	go func() {
		if _, ok := <-sig; ok {
			restore()
			os.Exit(130)
		}
	}()
	if err := os.WriteFile(m.file, bytes.Replace(orig, []byte(m.old), []byte(m.new), 1), 0o644); err != nil {
		restore() // a write that failed half way (fatal exits without the deferred restore)
		fatal(err)
	}
	build := "./..."
	if m.model() {
		build = "./internal/kernel/..." // the model checker builds on the kernel alone
	}
	if out, err := exec.Command("go", "build", build).CombinedOutput(); err != nil {
		return result{why: "does not compile: " + firstLine(string(out))}
	}
	return oracle()
}

// explore runs the explorer for budget.
func explore(budget time.Duration) result {
	// -v: a passing test prints its count (t.Logf) only when verbose.
	cmd := exec.Command("go", "test", "./explore", "-run", "TestExplore$", "-count=1", "-v", "-ledger=false",
		"-budget", budget.String(), "-timeout", (budget + 30*time.Minute).String())
	out, _ := cmd.CombinedOutput()
	r := result{}
	if c := countRe.FindSubmatch(out); c != nil {
		r.schedules, r.took = string(c[1]), string(c[2])
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Text()
		if s := seedRe.FindStringSubmatch(line); s != nil && !r.killed {
			r.killed = true
			r.why = strings.TrimSpace(s[0])
			if strings.HasSuffix(r.why, "broken:") && sc.Scan() { // the first of them
				r.why += " " + strings.TrimSpace(sc.Text())
			}
		}
		if strings.HasPrefix(line, "panic:") && !r.killed {
			r.killed, r.why = true, line
		}
	}
	if r.schedules == "" && !r.killed {
		r.why = "the explorer did not run: " + lastLines(string(out), 5)
	}
	if len(r.why) > 300 {
		r.why = r.why[:300] + "…"
	}
	return r
}

var (
	statesRe = regexp.MustCompile(`: (\d+) distinct states`)
	brokeRe  = regexp.MustCompile(`check_test.go:\d+: (.+?): ((?:I\d+|W|L): .*)`)
)

// model runs the model checker on a kernel mutant for budget: killed when
// an invariant breaks. It reports how many states it explored.
func model(budget time.Duration) result {
	start := time.Now()
	cmd := exec.Command("go", "test", "./internal/kernel/check", "-run", "TestModelCheck$", "-count=1", "-v",
		"-budget", budget.String(), "-timeout", (budget + 10*time.Minute).String())
	out, _ := cmd.CombinedOutput()
	r := result{took: time.Since(start).Round(time.Second).String()}
	n := 0
	for _, c := range statesRe.FindAllSubmatch(out, -1) {
		var k int
		fmt.Sscan(string(c[1]), &k)
		n += k
	}
	r.schedules = fmt.Sprintf("%d states", n)
	if b := brokeRe.FindSubmatch(out); b != nil {
		r.killed, r.why = true, string(b[1])+": "+string(b[2])
	} else if !bytes.Contains(out, []byte("distinct states in all")) {
		r.why = "the model checker did not run: " + lastLines(string(out), 5)
	}
	if len(r.why) > 300 {
		r.why = r.why[:300] + "…"
	}
	return r
}

// applyBackstop runs m's backstop test, first on the unmutated code (a
// test that fails there, a flake or a test broken by another change, would
// "kill" every mutant: it does not count), then with m applied: killed
// when it fails there, by an assertion, a panic or its timeout.
func applyBackstop(m mutant, bs backstop) result {
	run := func() (string, error) {
		out, err := exec.Command("go", "test", bs.pkg, "-run", "^"+bs.test+"$", "-count=1", "-timeout", "5m").CombinedOutput()
		return string(out), err
	}
	if out, err := run(); err != nil || strings.Contains(out, "no tests to run") {
		return result{why: "the backstop does not pass on the unmutated code: " + lastLines(out, 5)}
	}
	return withMutant(m, func() result {
		start := time.Now()
		out, err := run()
		r := result{took: time.Since(start).Round(time.Second).String()}
		if err != nil {
			r.killed, r.why = true, firstLine(lastLines(out, 5))
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "--- FAIL: ") || strings.HasPrefix(l, "panic: ") {
					r.why = strings.TrimSpace(l)
					break
				}
			}
		}
		return r
	})
}

// table runs the kernel's decision table.
func table() result {
	start := time.Now()
	out, err := exec.Command("go", "test", "./internal/kernel", "-run", "TestDecisionTable$", "-count=1").CombinedOutput()
	r := result{took: time.Since(start).Round(time.Second).String(), schedules: "every combination's states"}
	if err != nil {
		r.killed, r.why = true, "decision table: "+firstFailure(string(out))
	}
	return r
}

// firstFailure is the first line of a test's output that names a broken
// rule.
func firstFailure(out string) string {
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "broken for") || strings.Contains(l, "want") {
			l = strings.TrimSpace(l)
			if len(l) > 250 {
				l = l[:250] + "…"
			}
			return l
		}
	}
	return firstLine(out)
}

// all is every mutant; those in the kernel are the model checker's.
func all() []mutant { return append(append([]mutant{}, mutants...), kernelMutants...) }

func (m mutant) oracle() string {
	if m.model() {
		return "model checker"
	}
	if tableKernel[m.name] {
		return "decision table"
	}
	if bs, ok := contract[m.name]; ok {
		return "test " + bs.test
	}
	if bs, ok := backstops[m.name]; ok {
		return "explorer, backstop " + bs.test
	}
	return "explorer"
}

// root is the repository's root: the directory of its go.work.
func root() string {
	out, err := exec.Command("go", "env", "GOWORK").Output()
	if err != nil || strings.TrimSpace(string(out)) == "" || strings.TrimSpace(string(out)) == "off" {
		fatal(fmt.Errorf("find the repository root (go env GOWORK): %v", err))
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

func firstLine(s string) string { return strings.SplitN(strings.TrimSpace(s), "\n", 2)[0] }

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], " | ")
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "mutate:", err)
	os.Exit(2)
}
