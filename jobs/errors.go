package jobs

import "errors"

var (
	// ErrNotJob is returned when a record holds no job: its checkpoint or
	// outcome is not a job's state (another tenant's idempotency key, or a
	// state of a newer format).
	ErrNotJob = errors.New("not a job")

	// ErrUnknownKind is returned when a worker is asked to run a job of a
	// kind it did not register.
	ErrUnknownKind = errors.New("unknown job kind")

	// ErrNotParked is returned by Queue.Retry for a job that is not parked:
	// only a parked job waits for an operator.
	ErrNotParked = errors.New("job is not parked")

	// ErrRunning is returned by Queue.Cancel for a job a live worker is
	// running: its claim cannot be taken from it. Cancel it once it is
	// parked, or wait for it.
	ErrRunning = errors.New("job is running")

	// ErrFinal is returned by Queue.Cancel and Queue.Retry for a job that
	// has ended (succeeded, failed or cancelled): its outcome is final. A
	// new run needs a new job id.
	ErrFinal = errors.New("job has ended")

	// ErrDuplicate is returned by Queue.Submit with RefuseDuplicate for a
	// job id that names a job another submission wrote; the job is returned
	// with it. Nothing was written.
	ErrDuplicate = errors.New("job submitted before")

	// ErrInvalid is returned for a bad argument: a kind, step or schedule
	// that does not validate, an option out of range. Nothing was written.
	ErrInvalid = errors.New("invalid argument")
)
