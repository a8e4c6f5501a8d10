// Command idem is the idempotency service. The HTTP service is not built yet;
// see the issues.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "idem: the HTTP service is not built yet; the library is in ./etcdstore")
	os.Exit(2)
}
