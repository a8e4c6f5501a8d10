package tlsfiles

import (
	"os"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/testcerts"
)

// A rotated certificate is served from the next handshake on; a half-written
// one is not served, the previous one is.
func TestKeypairReloadsRotatedFiles(t *testing.T) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "ca")
	if err != nil {
		t.Fatal(err)
	}
	first, err := ca.Issue("first", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	second, err := ca.Issue("second", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := dir+"/tls.crt", dir+"/tls.key"
	install := func(f testcerts.Files, at time.Time) {
		for _, p := range [][2]string{{f.CertFile, certFile}, {f.KeyFile, keyFile}} {
			b, err := os.ReadFile(p[0])
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p[1], b, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chtimes(p[1], at, at); err != nil {
				t.Fatal(err)
			}
		}
	}
	cn := func(k *Keypair) string {
		c, err := k.GetCertificate(nil)
		if err != nil {
			t.Fatal(err)
		}
		if c.Leaf == nil {
			t.Fatal("no parsed leaf")
		}
		return c.Leaf.Subject.CommonName
	}
	now := time.Now()
	install(first, now)
	k, err := LoadKeypair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	if got := cn(k); got != "first" {
		t.Fatalf("serving %q; want first", got)
	}
	install(second, now.Add(time.Second))
	if got := cn(k); got != "second" {
		t.Fatalf("after rotation serving %q; want second", got)
	}
	if err := os.WriteFile(certFile, []byte("-----BEGIN CERT"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := cn(k); got != "second" {
		t.Fatalf("with a half-written certificate serving %q; want the previous one", got)
	}
	if _, err := LoadKeypair(certFile, keyFile); err == nil {
		t.Fatal("LoadKeypair accepted a broken certificate")
	}
}

func TestServerConfigRefusesInconsistentSettings(t *testing.T) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "ca")
	if err != nil {
		t.Fatal(err)
	}
	s, err := ca.Issue("s", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ServerConfig(s.CertFile, s.KeyFile, "", RequireClientCert); err == nil {
		t.Error("client certificates required without a client CA")
	}
	if _, err := ServerConfig(s.CertFile, s.KeyFile, ca.CertFile, NoClientCert); err == nil {
		t.Error("a client CA that is never used")
	}
	if _, err := ServerConfig(s.CertFile, s.KeyFile, s.KeyFile, RequireClientCert); err == nil {
		t.Error("a client CA file without certificates")
	}
	if _, err := ServerConfig(s.CertFile, "", "", NoClientCert); err == nil {
		t.Error("a certificate without its key")
	}
}
