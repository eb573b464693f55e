// Command kube-streams serves the two kubelet endpoints that the API server proxies to a node
// for the node runner's pods (tests/kube/noderunner.py): `kubectl logs [-f]` reaches
// /containerLogs/NS/POD/CONTAINER and `kubectl port-forward` reaches /portForward/NS/POD, spoken
// with the kubelet's own streaming library (k8s.io/cri-streaming: SPDY and WebSocket), so the
// real kubectl and kube-apiserver are on the path end to end.
//
// The node runner publishes each pod under -state as STATE/NS/POD/{netns,logs/CONTAINER.log,
// logs/CONTAINER.previous.log, logs/CONTAINER.exited}; a pod whose directory is gone is gone.
// A forwarded connection is dialled to localhost:PORT inside the pod's network namespace, as
// containerd does, so a server that listens only on the pod's IP is not reached, as on a node.
package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/cri-streaming/pkg/streaming/portforward"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:10250", "address to serve on (TLS, a certificate of its own)")
	state := flag.String("state", "", "the node runner's pod directory")
	flag.Parse()
	if *state == "" {
		log.Fatal("kube-streams: -state is required")
	}
	s := &server{state: *state}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })
	mux.HandleFunc("GET /containerLogs/{ns}/{pod}/{container}", s.logs)
	mux.HandleFunc("/portForward/{ns}/{pod}", s.portForward)
	mux.HandleFunc("/portForward/{ns}/{pod}/{uid}", s.portForward)
	cert, err := selfSigned()
	if err != nil {
		log.Fatalf("kube-streams: %v", err)
	}
	srv := &http.Server{Addr: *listen, Handler: mux, TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}}}
	log.Printf("kube-streams: serving %s for the pods under %s", *listen, *state)
	log.Fatal(srv.ListenAndServeTLS("", ""))
}

type server struct{ state string }

func (s *server) pod(r *http.Request) string {
	return filepath.Join(s.state, filepath.Base(r.PathValue("ns")), filepath.Base(r.PathValue("pod")))
}

// logs plays the kubelet's GET /containerLogs: follow, tailLines, limitBytes and previous; it
// refuses what it does not implement rather than answer something else.
func (s *server) logs(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for _, unsupported := range []string{"sinceSeconds", "sinceTime", "timestamps"} {
		if q.Get(unsupported) != "" && q.Get(unsupported) != "false" {
			http.Error(w, "kube-streams: "+unsupported+" is not implemented", http.StatusBadRequest)
			return
		}
	}
	dir := filepath.Join(s.pod(r), "logs")
	name := filepath.Base(r.PathValue("container"))
	path := filepath.Join(dir, name+".log")
	if q.Get("previous") == "true" {
		path = filepath.Join(dir, name+".previous.log")
	}
	f, err := os.Open(path)
	if err != nil {
		http.Error(w, fmt.Sprintf("container %q in pod %q is waiting to start", name, r.PathValue("pod")), http.StatusBadRequest)
		return
	}
	defer f.Close()
	if n, err := strconv.Atoi(q.Get("tailLines")); err == nil && n >= 0 {
		if err := seekTail(f, n); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
	}
	var out io.Writer = w
	if n, err := strconv.ParseInt(q.Get("limitBytes"), 10, 64); err == nil && n > 0 {
		out = &limited{w: w, left: n}
	}
	w.Header().Set("Content-Type", "text/plain")
	follow := q.Get("follow") == "true" && q.Get("previous") != "true"
	buf := make([]byte, 32*1024)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if _, werr := out.Write(buf[:n]); werr != nil {
				return
			}
			if fl, ok := w.(http.Flusher); ok {
				fl.Flush()
			}
		}
		if err == io.EOF {
			if !follow || ended(dir, name) {
				if n == 0 {
					return
				}
				continue
			}
			select {
			case <-r.Context().Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
		} else if err != nil {
			return
		}
	}
}

// ended: the container's process exited (or its pod is gone), so a follower has read all.
func ended(dir, container string) bool {
	if _, err := os.Stat(dir); err != nil {
		return true
	}
	_, err := os.Stat(filepath.Join(dir, container+".exited"))
	return err == nil
}

// seekTail positions f before its last n lines.
func seekTail(f *os.File, n int) error {
	data, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	start := len(data)
	if n > 0 {
		body := bytes.TrimSuffix(data, []byte("\n"))
		idx := len(body)
		for k := 0; k < n && idx >= 0; k++ {
			idx = bytes.LastIndexByte(body[:idx], '\n')
		}
		start = idx + 1
	}
	_, err = f.Seek(int64(start), io.SeekStart)
	return err
}

type limited struct {
	w    io.Writer
	left int64
}

func (l *limited) Write(p []byte) (int, error) {
	if l.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.w.Write(p)
	l.left -= int64(n)
	return n, err
}

func (s *server) portForward(w http.ResponseWriter, r *http.Request) {
	dir := s.pod(r)
	if _, err := os.Stat(filepath.Join(dir, "netns")); err != nil {
		http.Error(w, fmt.Sprintf("pod %s/%s is not running on this node", r.PathValue("ns"), r.PathValue("pod")), http.StatusNotFound)
		return
	}
	opts, err := portforward.NewV4Options(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	portforward.ServePortForward(w, r, forwarder{dir: dir}, r.PathValue("pod"), r.PathValue("uid"), opts,
		4*time.Hour, 30*time.Second, portforward.SupportedProtocols)
}

type forwarder struct{ dir string }

func (f forwarder) PortForward(ctx context.Context, _ string, _ string, port int32, stream io.ReadWriteCloser) error {
	defer stream.Close()
	netns, err := os.ReadFile(filepath.Join(f.dir, "netns"))
	if err != nil {
		return fmt.Errorf("the pod is gone")
	}
	conn, err := dialIn(strings.TrimSpace(string(netns)), net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))))
	if err != nil {
		return fmt.Errorf("failed to connect to localhost:%d inside the pod: %w", port, err)
	}
	defer conn.Close()
	done := make(chan error, 2)
	go func() { _, err := io.Copy(conn, stream); done <- err }()
	go func() { _, err := io.Copy(stream, conn); done <- err }()
	select {
	case <-ctx.Done():
	case <-done:
	}
	return nil
}

// dialIn connects from inside the network namespace at nsPath: the socket keeps that
// namespace after the thread returns to its own.
func dialIn(nsPath, addr string) (net.Conn, error) {
	runtime.LockOSThread()
	own, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer own.Close()
	target, err := os.Open(nsPath)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	conn, dialErr := net.DialTimeout("tcp", addr, 5*time.Second)
	if err := unix.Setns(int(own.Fd()), unix.CLONE_NEWNET); err != nil {
		// the thread is left locked, so the runtime ends it with this goroutine
		return conn, errors.Join(dialErr, err)
	}
	runtime.UnlockOSThread()
	return conn, dialErr
}

func selfSigned() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kube-streams"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}
