package fencing_test

import (
	"errors"
	"fmt"

	"github.com/idem-dev/idem/fencing"
)

// A downstream service refuses a worker whose claim was taken over.
func ExampleChecker() {
	var charges fencing.Checker

	// The first worker claimed the key at revision 17 and stalled; the key
	// was taken over at revision 23 and the new owner wrote first.
	fmt.Println(charges.Check("order-42", 23))

	// The stalled worker wakes up and tries to write.
	err := charges.Check("order-42", 17)
	fmt.Println(errors.Is(err, fencing.ErrStale))
	// Output:
	// <nil>
	// true
}
