package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The clients in other languages (clients/python, clients/typescript) are
// tested against a real idem serve: their tests start this test binary as
// idem (IDEM_BIN, with IDEM_TEST_RUN_MAIN), cut replies with a proxy, kill
// workers, and count effects at a sink (clients/*/tests).
func clientTest(t *testing.T, dir string, name string, args ...string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil && !filepath.IsAbs(name) {
		t.Fatalf("%s is not installed: scripts/test-deps installs it", name)
	}
	cmd := exec.Command(name, args...)
	cmd.Dir = filepath.Join("..", "..", "clients", dir)
	cmd.Env = append(os.Environ(), "IDEM_BIN="+os.Args[0], "IDEM_TEST_RUN_MAIN=1", "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v in clients/%s: %v\n%s", name, args, dir, err, out)
	}
	t.Logf("%s", out)
}

func TestClientsPython(t *testing.T) {
	clientTest(t, "python", "/usr/bin/python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests")
}

func TestClientsTypeScript(t *testing.T) {
	clientTest(t, "typescript", "npm", "test", "--silent")
}
