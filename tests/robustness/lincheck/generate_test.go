package main

import (
	"fmt"
	"math/rand"
	"sort"
	"strconv"
	"testing"
	"time"
)

type genConfig struct {
	seed    int64
	ops     int
	clients int
	groups  int
	unknown float64 // the share of writes whose outcome is lost
}

// generate makes a linearizable history: sequential clients with random
// timings, each op taking effect at a random point of its interval, the
// results computed by a plain map at those points. A blocking read of a
// missing key fails (a timeout); a write of unknown outcome takes effect at
// a random time after its call, up to 2 ms after its client gave up on it,
// or never.
func generate(cfg genConfig) []tOp {
	rng := rand.New(rand.NewSource(cfg.seed))
	type planned struct {
		tOp
		at      int64
		applied bool
	}
	var plan []*planned
	const base = 1_700_000_000_000_000_000
	for c := 0; c < cfg.clients; c++ {
		t := int64(base)
		for i := 0; i < cfg.ops/cfg.clients; i++ {
			call := t + rng.Int63n(20_000)
			ret := call + 10_000 + rng.Int63n(500_000)
			t = ret
			p := &planned{tOp: randomOp(rng, int64(c), i, cfg.groups), applied: true}
			p.Call, p.Return, p.Status = call, ret, "ok"
			p.at = call + rng.Int63n(ret-call+1)
			if k, _ := parseKind(p.Op); !k.readOnly() && rng.Float64() < cfg.unknown {
				p.Status = "unknown"
				p.applied = rng.Intn(2) == 0
				p.at = call + rng.Int63n(ret-call+2_000_000)
			}
			plan = append(plan, p)
		}
	}
	sort.SliceStable(plan, func(i, j int) bool { return plan[i].at < plan[j].at })
	store := map[string]string{}
	var ops []tOp
	for _, p := range plan {
		if p.applied {
			p.Out = apply(store, &p.tOp)
		}
		if p.Status == "unknown" {
			p.Out = nil
		}
		ops = append(ops, p.tOp)
	}
	rng.Shuffle(len(ops), func(i, j int) { ops[i], ops[j] = ops[j], ops[i] })
	return ops
}

func randomOp(rng *rand.Rand, c int64, i, groups int) tOp {
	g := rng.Intn(groups)
	str := func() string { return fmt.Sprintf("g%d/k%d", g, rng.Intn(4)) }
	counter := func() string { return fmt.Sprintf("g%d/n%d", g, rng.Intn(2)) }
	some := func() []string {
		keys := []string{str()}
		for rng.Intn(2) == 0 && len(keys) < 4 {
			if rng.Intn(3) == 0 {
				keys = append(keys, counter())
			} else {
				keys = append(keys, str())
			}
		}
		return keys
	}
	value := fmt.Sprintf("c%d-%d", c, i)
	small := []string{"", "x", "y"}
	o := tOp{Client: c}
	switch n := rng.Intn(100); {
	case n < 20:
		o.Op, o.Keys, o.Values = "set", []string{str()}, []string{value}
	case n < 32:
		o.Op, o.Keys = "get", []string{str()}
	case n < 40:
		o.Op, o.Keys = "check", some()
	case n < 55:
		o.Op, o.Keys, o.Values = "add", []string{counter()}, []string{strconv.Itoa(rng.Intn(5) - 1)}
	case n < 65:
		o.Op, o.Keys, o.Values = "cas", []string{str()}, []string{small[rng.Intn(3)], small[1+rng.Intn(2)]}
	case n < 70:
		o.Op, o.Keys = "delete", []string{str()}
	case n < 75:
		o.Op, o.Keys = "wait", some()
	case n < 85:
		o.Op, o.Keys = "multi_get", some()
	case n < 93:
		o.Op, o.Keys = "multi_set", some()
		for range o.Keys {
			o.Values = append(o.Values, strconv.Itoa(rng.Intn(100)))
		}
	default:
		o.Op, o.Keys, o.Values = "append", []string{str()}, []string{value}
	}
	return o
}

// apply runs o on store, the reference the model is tested against: what
// o returns, and its status "fail" when it would block.
func apply(store map[string]string, o *tOp) interface{} {
	k := o.Keys[0]
	cur, exists := store[k]
	allExist := true
	for _, k := range o.Keys {
		if _, ok := store[k]; !ok {
			allExist = false
		}
	}
	switch o.Op {
	case "set":
		store[k] = o.Values[0]
	case "append":
		store[k] = cur + o.Values[0]
	case "multi_set":
		for i, k := range o.Keys {
			store[k] = o.Values[i]
		}
	case "get", "wait", "multi_get":
		if !allExist {
			o.Status = "fail"
			return nil
		}
		switch o.Op {
		case "get":
			return cur
		case "multi_get":
			vals := make([]string, len(o.Keys))
			for i, k := range o.Keys {
				vals[i] = store[k]
			}
			return vals
		}
	case "check":
		return allExist
	case "add":
		n, _ := strconv.ParseInt(cur, 10, 64)
		d, _ := strconv.ParseInt(o.Values[0], 10, 64)
		store[k] = strconv.FormatInt(n+d, 10)
		return n + d
	case "cas":
		switch {
		case !exists && o.Values[0] != "":
			return o.Values[0]
		case !exists || cur == o.Values[0]:
			store[k] = o.Values[1]
			return o.Values[1]
		}
		return cur
	case "delete":
		delete(store, k)
		return exists
	}
	return nil
}

func TestGeneratedHistoriesAreLinearizable(t *testing.T) {
	for seed := int64(1); seed <= 30; seed++ {
		ops := generate(genConfig{seed: seed, ops: 400, clients: 4, groups: 3, unknown: 0.02})
		if _, s := checked(t, ops...); s.Result != "ok" {
			t.Errorf("seed %d: result %q, illegal groups %v", seed, s.Result, s.IllegalGroups)
		}
	}
}

// A read of a value never written, put anywhere in a generated history,
// makes its group illegal, and only its group.
func TestGeneratedHistoriesWithABadReadAreIllegal(t *testing.T) {
	for seed := int64(1); seed <= 30; seed++ {
		ops := generate(genConfig{seed: seed, ops: 400, clients: 4, groups: 3, unknown: 0.02})
		rng := rand.New(rand.NewSource(seed))
		var reads []int
		for i, o := range ops {
			if (o.Op == "get" || o.Op == "multi_get") && o.Status == "ok" {
				reads = append(reads, i)
			}
		}
		bad := &ops[reads[rng.Intn(len(reads))]]
		if bad.Op == "get" {
			bad.Out = "never written"
		} else {
			vals := append([]string(nil), bad.Out.([]string)...)
			vals[rng.Intn(len(vals))] = "never written"
			bad.Out = vals
		}
		group := bad.Keys[0][:2]
		if _, s := checked(t, ops...); s.Result != "illegal" || fmt.Sprint(s.IllegalGroups) != "["+group+"]" {
			t.Errorf("seed %d, bad %s at %d: result %q, illegal groups %v, want [%s]",
				seed, bad.Op, bad.Call, s.Result, s.IllegalGroups, group)
		}
	}
}

var large = genConfig{seed: 42, ops: 20_000, clients: 8, groups: 16, unknown: 0.002}

// The size of history the robustness tests make, checked well within the
// default timeout; the time it took is logged (go test -v), not asserted.
func TestLargeHistory(t *testing.T) {
	ops := generate(large)
	start := time.Now()
	h, s := checked(t, ops...)
	if s.Result != "ok" {
		t.Fatalf("result %q, illegal groups %v", s.Result, s.IllegalGroups)
	}
	t.Logf("%d operations (%d unknown, %d dropped), %d clients, %d partitions: checked in %v",
		len(h.ops), h.unknown, h.dropped, h.clients, s.Partitions, time.Since(start))
}

func BenchmarkCheckLargeHistory(b *testing.B) {
	ops := generate(large)
	for i := 0; i < b.N; i++ {
		checked(b, ops...)
	}
}
