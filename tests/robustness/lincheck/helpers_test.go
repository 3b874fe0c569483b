package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// tOp is one line of a history, as a generator writes it.
type tOp struct {
	Client int64       `json:"client"`
	Op     string      `json:"op"`
	Keys   []string    `json:"keys"`
	Values []string    `json:"values,omitempty"`
	Call   int64       `json:"call"`
	Return int64       `json:"return"`
	Status string      `json:"status"`
	Out    interface{} `json:"out,omitempty"`
}

func set(c, call, ret int64, k, v string) tOp {
	return tOp{c, "set", []string{k}, []string{v}, call, ret, "ok", nil}
}

func get(c, call, ret int64, k, out string) tOp {
	return tOp{c, "get", []string{k}, nil, call, ret, "ok", out}
}

func check(c, call, ret int64, out bool, keys ...string) tOp {
	return tOp{c, "check", keys, nil, call, ret, "ok", out}
}

func add(c, call, ret int64, k, delta string, out int64) tOp {
	return tOp{c, "add", []string{k}, []string{delta}, call, ret, "ok", out}
}

func cas(c, call, ret int64, k, expected, desired, out string) tOp {
	return tOp{c, "cas", []string{k}, []string{expected, desired}, call, ret, "ok", out}
}

func del(c, call, ret int64, k string, out bool) tOp {
	return tOp{c, "delete", []string{k}, nil, call, ret, "ok", out}
}

func wait(c, call, ret int64, keys ...string) tOp {
	return tOp{c, "wait", keys, nil, call, ret, "ok", nil}
}

func multiGet(c, call, ret int64, keys []string, out ...string) tOp {
	return tOp{c, "multi_get", keys, nil, call, ret, "ok", out}
}

func multiSet(c, call, ret int64, keys []string, vals ...string) tOp {
	return tOp{c, "multi_set", keys, vals, call, ret, "ok", nil}
}

func appendOp(c, call, ret int64, k, suffix string) tOp {
	return tOp{c, "append", []string{k}, []string{suffix}, call, ret, "ok", nil}
}

// unknown is o with its outcome unknown, as when its answer was lost.
func (o tOp) unknown() tOp {
	o.Status, o.Out = "unknown", nil
	return o
}

func (o tOp) failed() tOp {
	o.Status, o.Out = "fail", nil
	return o
}

func jsonl(t testing.TB, ops []tOp) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	for _, o := range ops {
		if err := enc.Encode(o); err != nil {
			t.Fatal(err)
		}
	}
	return b.Bytes()
}

// checked reads ops as one file and checks them with no timeout.
func checked(t testing.TB, ops ...tOp) (*history, *summary) {
	t.Helper()
	r := newReader()
	if err := r.read("test.jsonl", bytes.NewReader(jsonl(t, ops))); err != nil {
		t.Fatalf("reading the history: %v", err)
	}
	h, err := r.finish()
	if err != nil {
		t.Fatalf("reading the history: %v", err)
	}
	parts := toPartitions(h)
	checkAll(parts, time.Time{}, 2, startGuard(0))
	return h, summarize(h, parts, 0)
}

func expectResult(t *testing.T, want string, ops ...tOp) {
	t.Helper()
	if _, s := checked(t, ops...); s.Result != want {
		t.Errorf("result %q, want %q; history:\n%s", s.Result, want, jsonl(t, ops))
	}
}

func writeFile(t testing.TB, dir, name string, data []byte) string {
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
