package etcdtest

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy is a TCP proxy on loopback in front of one address, for cutting,
// delaying and resetting one link. It binds a port the kernel picks. Faults
// apply to both directions and to connections already open.
type Proxy struct {
	ln     net.Listener
	target string

	blackhole atomic.Bool
	delay     atomic.Int64 // one-way delay in nanoseconds
	jitter    atomic.Int64 // extra random delay bound in nanoseconds

	// Counters that let a fault test prove the fault fired.
	Forwarded atomic.Int64 // bytes delivered
	Dropped   atomic.Int64 // bytes swallowed by a blackhole
	Resets    atomic.Int64 // connections closed by DropConnections

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	closed  bool
	release chan struct{} // while held (Hold): closed by Heal
	wg      sync.WaitGroup
}

// NewProxy starts a proxy to target ("host:port").
func NewProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: make(map[net.Conn]struct{})}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the proxy's "host:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// URL returns the proxy's address as an http URL.
func (p *Proxy) URL() string { return "http://" + p.Addr() }

// Blackhole silently drops all traffic, in both directions, without closing
// connections: like a network partition, the peer sees nothing at all.
func (p *Proxy) Blackhole() { p.blackhole.Store(true) }

// Hold keeps every chunk, in both directions, until Heal, then delivers
// them in order: a partition that TCP outlives (its retransmissions deliver
// what was sent once the link is back), so a request sent during the cut
// arrives late, after the cut heals.
func (p *Proxy) Hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.release == nil {
		p.release = make(chan struct{})
	}
}

// Heal ends a blackhole and a hold, and removes delays.
func (p *Proxy) Heal() {
	p.blackhole.Store(false)
	p.delay.Store(0)
	p.jitter.Store(0)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.release != nil {
		close(p.release)
		p.release = nil
	}
}

// held returns the channel a chunk read now waits on, or nil.
func (p *Proxy) held() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.release
}

// Delay adds d (plus up to jitter) to every chunk in each direction, so a
// round trip through the proxy costs about 2d more.
func (p *Proxy) Delay(d, jitter time.Duration) {
	p.delay.Store(int64(d))
	p.jitter.Store(int64(jitter))
}

// DropConnections closes every open connection (a reset); new ones are
// accepted.
func (p *Proxy) DropConnections() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
		p.Resets.Add(1)
	}
}

// Retarget sends new connections to target and closes every open one: the
// address now reaches another server (a cluster restored from a snapshot,
// say), and clients reconnect to it through the same address.
func (p *Proxy) Retarget(target string) {
	p.mu.Lock()
	p.target = target
	p.mu.Unlock()
	p.DropConnections()
}

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	if p.release != nil {
		close(p.release) // held chunks go nowhere: their connections close
		p.release = nil
	}
	p.mu.Unlock()
	p.ln.Close()
	p.DropConnections()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		target := p.target
		p.mu.Unlock()
		out, err := net.DialTimeout("tcp", target, 5*time.Second)
		if err != nil {
			in.Close()
			continue
		}
		if !p.track(in, out) {
			return
		}
		p.wg.Add(2)
		go p.pipe(out, in)
		go p.pipe(in, out)
	}
}

func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		for _, c := range cs {
			c.Close()
		}
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

type chunk struct {
	at   time.Time
	data []byte
	hold chan struct{} // deliver once closed (Hold)
}

// pipe copies src to dst through a queue, so a delay shifts every chunk by
// the same amount instead of throttling the stream.
func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	queue := make(chan chunk, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for c := range queue {
			if c.hold != nil {
				<-c.hold // held until Heal
			}
			if wait := time.Until(c.at); wait > 0 {
				time.Sleep(wait) // simulated wire latency, not synchronisation
			}
			if _, err := dst.Write(c.data); err != nil {
				for range queue { // drain so the reader is never stuck
				}
				return
			}
			p.Forwarded.Add(int64(len(c.data)))
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if p.blackhole.Load() {
				p.Dropped.Add(int64(n))
			} else {
				d := time.Duration(p.delay.Load())
				if j := p.jitter.Load(); j > 0 {
					d += time.Duration(time.Now().UnixNano() % j)
				}
				queue <- chunk{at: time.Now().Add(d), data: append([]byte(nil), buf[:n]...), hold: p.held()}
			}
		}
		if err != nil { // EOF, reset, or closed by DropConnections
			break
		}
	}
	close(queue)
	<-done
	p.untrack(src)
	p.untrack(dst)
}
