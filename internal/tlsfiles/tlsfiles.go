// Package tlsfiles loads TLS key pairs and CA bundles from PEM files, and
// reloads a key pair when its files change, so that certificates rotated in
// place (cert-manager renewing a Secret, a mounted volume updated by the
// kubelet) are picked up by the next handshake without a restart.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
)

// Keypair is a certificate and its key, read from files and re-read when
// either file's modification time or size changes. A failed reload (a
// half-written pair) keeps the previous pair and is retried on the next
// handshake.
type Keypair struct {
	certFile, keyFile string

	mu    sync.Mutex
	cert  *tls.Certificate
	stamp [2]fileStamp
}

type fileStamp struct {
	mod  time.Time
	size int64
}

// LoadKeypair reads a PEM certificate (chain) and its key, failing now if
// they do not load or do not match.
func LoadKeypair(certFile, keyFile string) (*Keypair, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("a certificate and its key go together")
	}
	k := &Keypair{certFile: certFile, keyFile: keyFile}
	if _, err := k.get(); err != nil {
		return nil, err
	}
	return k, nil
}

func stampOf(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{fi.ModTime(), fi.Size()}, nil
}

func (k *Keypair) get() (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	cs, errC := stampOf(k.certFile)
	ks, errK := stampOf(k.keyFile)
	if k.cert != nil && (errC != nil || errK != nil || [2]fileStamp{cs, ks} == k.stamp) {
		return k.cert, nil
	}
	pair, err := tls.LoadX509KeyPair(k.certFile, k.keyFile)
	if err != nil {
		if k.cert != nil {
			return k.cert, nil
		}
		return nil, fmt.Errorf("certificate %s, key %s: %w", k.certFile, k.keyFile, err)
	}
	k.cert, k.stamp = &pair, [2]fileStamp{cs, ks}
	return k.cert, nil
}

// GetCertificate is for tls.Config.GetCertificate (servers).
func (k *Keypair) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) { return k.get() }

// GetClientCertificate is for tls.Config.GetClientCertificate (clients).
func (k *Keypair) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return k.get()
}

// LoadCAs reads a PEM bundle of CA certificates.
func LoadCAs(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no PEM certificates", path)
	}
	return pool, nil
}

// ClientAuth says what a server asks of its clients' certificates.
type ClientAuth int

const (
	// NoClientCert: clients are not asked for a certificate.
	NoClientCert ClientAuth = iota
	// RequireClientCert: a client without a certificate signed by the
	// client CA is refused in the handshake.
	RequireClientCert
	// VerifyClientCertIfGiven: a certificate is optional, but one that is
	// sent must be signed by the client CA.
	VerifyClientCertIfGiven
)

// ServerConfig is a TLS 1.2+ server configuration serving the key pair in
// certFile and keyFile (reloaded when they change) and, with clientCAFile,
// verifying client certificates against it as auth says.
func ServerConfig(certFile, keyFile, clientCAFile string, auth ClientAuth) (*tls.Config, error) {
	kp, err := LoadKeypair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: kp.GetCertificate}
	if clientCAFile == "" {
		if auth != NoClientCert {
			return nil, errors.New("client certificates need a client CA")
		}
		return cfg, nil
	}
	if cfg.ClientCAs, err = LoadCAs(clientCAFile); err != nil {
		return nil, fmt.Errorf("client CA: %w", err)
	}
	switch auth {
	case RequireClientCert:
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	case VerifyClientCertIfGiven:
		cfg.ClientAuth = tls.VerifyClientCertIfGiven
	default:
		return nil, errors.New("a client CA is given but client certificates are not asked for")
	}
	return cfg, nil
}
