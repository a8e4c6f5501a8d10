// Package testcerts makes certificate authorities and certificates at test
// time, for tests of TLS between idem, etcd and idem's clients. Keys are
// ECDSA P-256; nothing here is for production.
package testcerts

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// CA is a certificate authority.
type CA struct {
	Cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// CertFile is the CA certificate in PEM, in the directory given to NewCA.
	CertFile string
	dir      string
	serial   int64
}

// Files are a certificate and its key in PEM files.
type Files struct {
	CertFile, KeyFile string
}

// NewCA makes a CA named name and writes its certificate to dir.
func NewCA(dir, name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{Cert: cert, key: key, dir: dir, serial: 1, CertFile: filepath.Join(dir, name+"-ca.pem")}
	return ca, writePEM(ca.CertFile, "CERTIFICATE", der)
}

// Options shape an issued certificate.
type Options struct {
	// Server makes a server certificate for 127.0.0.1, ::1 and localhost;
	// otherwise it is a client certificate.
	Server bool
	// Expired makes a certificate whose validity ended an hour ago.
	Expired bool
}

// Issue makes a certificate with common name cn, signed by ca, and writes it
// and its key to ca's directory.
func (ca *CA) Issue(cn string, o Options) (Files, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Files{}, err
	}
	ca.serial++
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(ca.serial),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(12 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if o.Server {
		// etcd's embedded server also dials itself as a client.
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
		tmpl.DNSNames = []string{"localhost"}
	}
	if o.Expired {
		tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-48*time.Hour), time.Now().Add(-time.Hour)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		return Files{}, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return Files{}, err
	}
	base := filepath.Join(ca.dir, fileName(ca, cn, o))
	f := Files{CertFile: base + ".pem", KeyFile: base + "-key.pem"}
	if err := writePEM(f.CertFile, "CERTIFICATE", der); err != nil {
		return Files{}, err
	}
	return f, writePEM(f.KeyFile, "EC PRIVATE KEY", kder)
}

func fileName(ca *CA, cn string, o Options) string {
	safe := []byte(cn)
	for i, c := range safe {
		if c == '/' || c == '\\' || c == 0 {
			safe[i] = '_'
		}
	}
	n := ca.Cert.Subject.CommonName + "-" + string(safe) + "-" + big.NewInt(ca.serial).String()
	if o.Expired {
		n += "-expired"
	}
	return n
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}
