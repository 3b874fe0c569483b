package main

import (
	"fmt"
	"testing"
)

var ab = []string{"g/a", "g/b"}

func TestLinearizableHistories(t *testing.T) {
	cases := []struct {
		name string
		ops  []tOp
	}{
		{"sequential", []tOp{
			set(1, 0, 10, "g/a", "1"),
			get(1, 20, 30, "g/a", "1"),
			check(1, 40, 50, true, "g/a"),
			check(1, 60, 70, false, "g/a", "g/b"),
			del(1, 80, 90, "g/a", true),
			check(1, 100, 110, false, "g/a"),
			del(1, 120, 130, "g/a", false),
		}},
		{"overlapping writes read as the first", []tOp{
			set(1, 0, 10, "g/a", "1"),
			set(2, 0, 10, "g/a", "2"),
			get(3, 20, 30, "g/a", "1"),
			get(3, 40, 50, "g/a", "1"),
		}},
		{"overlapping writes read as the second", []tOp{
			set(1, 0, 10, "g/a", "1"),
			set(2, 0, 10, "g/a", "2"),
			get(3, 20, 30, "g/a", "2"),
		}},
		{"a read during a write sees either value", []tOp{
			set(1, 0, 10, "g/a", "1"),
			set(1, 20, 60, "g/a", "2"),
			get(2, 30, 40, "g/a", "2"),
			get(3, 30, 50, "g/a", "1"), // linearized before client 2's read
		}},
		{"times that touch are concurrent", []tOp{
			set(1, 0, 10, "g/a", "1"),
			get(2, 10, 20, "g/a", "1"),
		}},
		{"a blocking get returns after a concurrent set", []tOp{
			get(1, 0, 100, "g/a", "x"),
			set(2, 50, 60, "g/a", "x"),
		}},
		{"wait returns once both keys exist", []tOp{
			wait(1, 0, 100, "g/a", "g/b"),
			set(2, 10, 20, "g/a", "1"),
			set(2, 30, 40, "g/b", "1"),
		}},
		{"an unknown add that never took effect", []tOp{
			add(1, 0, 10, "g/n", "5", 5).unknown(),
			add(2, 20, 30, "g/n", "1", 1),
			get(2, 40, 50, "g/n", "1"),
		}},
		{"an unknown add that took effect", []tOp{
			add(1, 0, 10, "g/n", "5", 5).unknown(),
			add(2, 20, 30, "g/n", "1", 6),
			get(2, 40, 50, "g/n", "6"),
		}},
		{"an unknown add that took effect after its client gave up", []tOp{
			add(1, 0, 10, "g/n", "5", 5).unknown(),
			add(2, 20, 30, "g/n", "1", 1),
			add(1, 40, 50, "g/n", "1", 2),
			get(2, 60, 70, "g/n", "7"),
		}},
		{"an unknown set seen later", []tOp{
			set(1, 0, 10, "g/a", "x").unknown(),
			check(2, 20, 30, false, "g/a"),
			get(2, 40, 50, "g/a", "x"),
		}},
		{"an unknown cas, a delete and a multi_set that took effect", []tOp{
			set(1, 0, 10, "g/a", "x"),
			cas(1, 20, 30, "g/a", "x", "y", "").unknown(),
			del(2, 20, 30, "g/b", false).unknown(),
			multiSet(3, 20, 30, []string{"g/c"}, "z").unknown(),
			get(1, 40, 50, "g/a", "y"),
			get(1, 60, 70, "g/c", "z"),
		}},
		{"an unknown add on a value that is not a number changes nothing", []tOp{
			set(1, 0, 10, "g/a", "x"),
			add(1, 20, 30, "g/a", "1", 0).unknown(),
			get(1, 40, 50, "g/a", "x"),
		}},
		{"failed ops are dropped", []tOp{
			set(1, 0, 10, "g/a", "1").failed(),
			get(1, 20, 30, "g/a", "never written").failed(),
			check(1, 40, 50, false, "g/a"),
		}},
		{"multi_get sees a multi_set whole (before)", []tOp{
			multiSet(1, 0, 10, ab, "1", "1"),
			multiSet(1, 20, 30, ab, "2", "2"),
			multiGet(2, 15, 25, ab, "1", "1"),
		}},
		{"multi_get sees a multi_set whole (after)", []tOp{
			multiSet(1, 0, 10, ab, "1", "1"),
			multiSet(1, 20, 30, ab, "2", "2"),
			multiGet(2, 15, 25, ab, "2", "2"),
		}},
		{"multi_set with a key twice keeps the last value", []tOp{
			multiSet(1, 0, 10, []string{"g/a", "g/a"}, "1", "2"),
			get(1, 20, 30, "g/a", "2"),
		}},
		{"cas on a missing key expecting empty writes", []tOp{
			cas(1, 0, 10, "g/a", "", "x", "x"),
			get(1, 20, 30, "g/a", "x"),
		}},
		{"cas on a missing key expecting a value returns it and writes nothing", []tOp{
			cas(1, 0, 10, "g/a", "y", "x", "y"),
			check(1, 20, 30, false, "g/a"),
		}},
		{"cas on a match writes", []tOp{
			set(1, 0, 10, "g/a", "1"),
			cas(1, 20, 30, "g/a", "1", "2", "2"),
			get(1, 40, 50, "g/a", "2"),
		}},
		{"cas on a mismatch returns the value and writes nothing", []tOp{
			set(1, 0, 10, "g/a", "1"),
			cas(1, 20, 30, "g/a", "3", "2", "1"),
			get(1, 40, 50, "g/a", "1"),
		}},
		{"cas expecting empty matches an empty value", []tOp{
			set(1, 0, 10, "g/a", ""),
			get(1, 20, 30, "g/a", ""),
			cas(1, 40, 50, "g/a", "", "x", "x"),
		}},
		{"delete then check", []tOp{
			set(1, 0, 10, "g/a", "1"),
			set(1, 20, 30, "g/b", "1"),
			del(1, 40, 50, "g/a", true),
			check(1, 60, 70, false, "g/a", "g/b"),
			check(1, 80, 90, true, "g/b"),
		}},
		{"append to a missing key, then again", []tOp{
			appendOp(1, 0, 10, "g/a", "x"),
			appendOp(1, 20, 30, "g/a", "y"),
			get(1, 40, 50, "g/a", "xy"),
		}},
		{"concurrent appends in either order", []tOp{
			appendOp(1, 0, 10, "g/a", "x"),
			appendOp(2, 0, 10, "g/a", "y"),
			get(1, 40, 50, "g/a", "yx"),
		}},
		{"add stores a decimal string", []tOp{
			add(1, 0, 10, "g/n", "7", 7),
			get(1, 20, 30, "g/n", "7"),
			add(1, 40, 50, "g/n", "-10", -3),
			set(1, 60, 70, "g/n", "40"),
			add(1, 80, 90, "g/n", "2", 42),
		}},
		{"concurrent adds", []tOp{
			add(1, 0, 10, "g/n", "1", 2),
			add(2, 0, 10, "g/n", "1", 1),
			get(3, 20, 30, "g/n", "2"),
		}},
		{"groups are independent", []tOp{
			set(1, 0, 10, "g/a", "1"),
			set(1, 20, 30, "h/a", "2"),
			get(2, 40, 50, "g/a", "1"),
			get(2, 60, 70, "h/a", "2"),
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { expectResult(t, "ok", c.ops...) })
	}
}

func TestIllegalHistories(t *testing.T) {
	cases := []struct {
		name string
		ops  []tOp
	}{
		{"a stale read", []tOp{
			set(1, 0, 10, "g/a", "1"),
			set(1, 20, 30, "g/a", "2"),
			get(2, 40, 50, "g/a", "1"),
		}},
		{"a lost acknowledged write", []tOp{
			set(1, 0, 10, "g/a", "1"),
			check(2, 20, 30, false, "g/a"),
		}},
		{"readers disagree after the writes", []tOp{
			set(1, 0, 10, "g/a", "1"),
			set(2, 0, 10, "g/a", "2"),
			get(3, 20, 30, "g/a", "1"),
			get(4, 40, 50, "g/a", "2"),
		}},
		{"a value read before it is written", []tOp{
			get(1, 0, 40, "g/a", "x"),
			set(2, 50, 60, "g/a", "x"),
		}},
		{"wait returns before a key exists", []tOp{
			wait(1, 0, 25, "g/a", "g/b"),
			set(2, 10, 20, "g/a", "1"),
			set(2, 30, 40, "g/b", "1"),
		}},
		{"a read of a value never written", []tOp{
			set(1, 0, 10, "g/a", "1"),
			get(2, 0, 20, "g/a", "zzz"),
		}},
		{"an add applied twice", []tOp{
			add(1, 0, 10, "g/n", "1", 1),
			add(2, 20, 30, "g/n", "1", 3),
		}},
		{"concurrent adds skip a sum", []tOp{
			add(1, 0, 10, "g/n", "1", 1),
			add(2, 0, 10, "g/n", "1", 3),
		}},
		{"concurrent adds lose an update", []tOp{
			add(1, 0, 10, "g/n", "1", 1),
			add(2, 0, 10, "g/n", "1", 1),
		}},
		{"an unknown add seen, then unseen", []tOp{
			add(1, 0, 10, "g/n", "5", 5).unknown(),
			add(2, 20, 30, "g/n", "1", 6),
			get(2, 40, 50, "g/n", "1"),
		}},
		{"a get of a counter that is not its decimal string", []tOp{
			add(1, 0, 10, "g/n", "7", 7),
			get(1, 20, 30, "g/n", "07"),
		}},
		{"an ok add on a value that is not a number", []tOp{
			set(1, 0, 10, "g/n", "x"),
			add(1, 20, 30, "g/n", "1", 1),
		}},
		{"multi_get sees half of a multi_set", []tOp{
			multiSet(1, 0, 10, ab, "1", "1"),
			multiSet(1, 20, 30, ab, "2", "2"),
			multiGet(2, 15, 25, ab, "1", "2"),
		}},
		{"multi_get sees the other half", []tOp{
			multiSet(1, 0, 10, ab, "1", "1"),
			multiSet(1, 20, 30, ab, "2", "2"),
			multiGet(2, 15, 25, ab, "2", "1"),
		}},
		{"cas on a mismatch claims to have written", []tOp{
			set(1, 0, 10, "g/a", "1"),
			cas(1, 20, 30, "g/a", "3", "2", "2"),
		}},
		{"cas on a missing key returns the desired value", []tOp{
			cas(1, 0, 10, "g/a", "y", "x", "x"),
		}},
		{"cas on a match that wrote nothing", []tOp{
			set(1, 0, 10, "g/a", "1"),
			cas(1, 20, 30, "g/a", "1", "2", "2"),
			get(1, 40, 50, "g/a", "1"),
		}},
		{"delete of a missing key says it existed", []tOp{
			del(1, 0, 10, "g/a", true),
		}},
		{"a key that survives its delete", []tOp{
			set(1, 0, 10, "g/a", "1"),
			del(1, 20, 30, "g/a", true),
			check(1, 40, 50, true, "g/a"),
		}},
		{"an append lost", []tOp{
			appendOp(1, 0, 10, "g/a", "x"),
			appendOp(2, 0, 10, "g/a", "y"),
			get(1, 40, 50, "g/a", "x"),
		}},
		{"one bad group among good ones", []tOp{
			set(1, 0, 10, "h/a", "1"),
			get(1, 20, 30, "h/a", "1"),
			set(2, 0, 10, "g/a", "1"),
			set(2, 20, 30, "g/a", "2"),
			get(3, 40, 50, "g/a", "1"),
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { expectResult(t, "illegal", c.ops...) })
	}
}

func TestIllegalGroupIsNamed(t *testing.T) {
	_, s := checked(t,
		set(1, 0, 10, "good/a", "1"),
		get(1, 20, 30, "good/a", "1"),
		set(2, 0, 10, "bad/a", "1"),
		check(2, 20, 30, false, "bad/a"),
	)
	if s.Result != "illegal" || len(s.IllegalGroups) != 1 || s.IllegalGroups[0] != "bad" {
		t.Fatalf("result %q, illegal groups %v; want illegal, [bad]", s.Result, s.IllegalGroups)
	}
	if s.Violations != 1 || s.Partitions != 2 {
		t.Errorf("violations %d of %d partitions, want 1 of 2", s.Violations, s.Partitions)
	}
}

// The model's states: equal ones hash alike whatever the order of the
// writes that made them, and a delete undoes a put.
func TestStateEqualityAndHash(t *testing.T) {
	g := &group{name: "g", ids: map[string]int{}}
	a, b := g.id("g/a"), g.id("g/b")
	x := emptyKV.edit(g)
	x.put(a, "1")
	x.put(b, "2")
	y := emptyKV.edit(g)
	y.put(b, "2")
	y.put(a, "0")
	y.put(a, "1")
	if !equalKV(x, y) || x.hash != y.hash {
		t.Errorf("same contents differ: %s (%x) and %s (%x)", describeState(x), x.hash, describeState(y), y.hash)
	}
	z := x.edit(g)
	z.remove(a)
	z.remove(b)
	if !equalKV(z, emptyKV) || z.hash != emptyKV.hash {
		t.Errorf("emptied state %s (%x) is not the empty one", describeState(z), z.hash)
	}
	w := emptyKV.edit(g)
	w.put(a, "")
	if equalKV(w, emptyKV) {
		t.Errorf("a key holding the empty string equals a missing key")
	}
	if equalKV(x, w) || describeState(x) != `{g/a="1", g/b="2"}` {
		t.Errorf("state %s", describeState(x))
	}
}

func TestWhyNot(t *testing.T) {
	g := &group{name: "g", ids: map[string]int{}}
	a, b, n := g.id("g/a"), g.id("g/b"), g.id("g/n")
	s := emptyKV.edit(g)
	s.put(a, "1")
	s.put(n, "x")
	in := func(kind opKind, keys []int, vals ...string) *op {
		o := &op{kind: kind, g: g, ids: keys, vals: vals}
		for _, id := range keys {
			o.keys = append(o.keys, g.keys[id])
		}
		return o
	}
	unknownSet := in(opSet, []int{a}, "2")
	unknownSet.unknown = true
	cases := []struct {
		in   *op
		out  *result
		want string
	}{
		{in(opWait, []int{a, b}), nil, "it would block: g/b missing"},
		{in(opMultiGet, []int{b, n}), &result{list: []string{"", "x"}}, "it would block: g/b missing"},
		{in(opAdd, []int{n}), &result{num: 1}, `g/n holds "x", not a number`},
		{in(opGet, []int{a}), &result{str: "2"}, `the store would return "1"`},
		{in(opCas, []int{b}, "y", "z"), &result{str: "z"}, `the store would return "y"`},
		{in(opCheck, []int{a, b}), &result{flag: true}, "the store would return false"},
		{in(opGet, []int{a}), &result{str: "1"}, "it fits here, but no order of the rest does"},
		{unknownSet, nil, "it may take effect here or later, or never; no choice leads anywhere"},
	}
	for _, c := range cases {
		if got := whyNot(s, c.in, c.out); got != c.want {
			t.Errorf("%s from %s: %q, want %q", describeOp(c.in, c.out), describeState(s), got, c.want)
		}
	}
}

func tcpGet(c, call, ret int64, k, out string) tOp {
	return tOp{c, "tcp_get", []string{k}, nil, call, ret, "ok", out}
}

func tcpMultiGet(c, call, ret int64, keys []string, out ...string) tOp {
	return tOp{c, "tcp_multi_get", keys, nil, call, ret, "ok", out}
}

// PyTorch's TCPStore reads: a missing key reads as "", all at one point.
func TestTcpStoreReads(t *testing.T) {
	expectResult(t, "ok",
		set(1, 0, 10, "g/a", "1"),
		del(1, 20, 30, "g/a", true),
		tcpGet(2, 40, 50, "g/a", ""),
		tcpMultiGet(2, 60, 70, ab, "", ""),
	)
	expectResult(t, "ok", // the delete may land between the wait and the read
		set(1, 0, 10, "g/a", "1"),
		tcpGet(2, 20, 60, "g/a", ""),
		del(1, 30, 40, "g/a", true),
	)
	expectResult(t, "illegal", // "" while the key certainly exists
		set(1, 0, 10, "g/a", "1"),
		tcpGet(2, 20, 30, "g/a", ""),
	)
	expectResult(t, "illegal", // half of a multi_set
		multiSet(1, 0, 10, ab, "1", "2"),
		multiSet(1, 20, 30, ab, "3", "4"),
		tcpMultiGet(2, 40, 50, ab, "3", "2"),
	)
}

// The group is what precedes a key's last "/": deeper keys are still split.
func TestGroupIsBeforeTheLastSlash(t *testing.T) {
	h, _ := checked(t,
		set(1, 0, 10, "/lin/g0/a", "1"),
		set(2, 0, 10, "/lin/g1/a", "1"),
		multiGet(3, 20, 30, []string{"/lin/g0/a", "/lin/g0/b"}, "1", "x").unknown(),
	)
	var names []string
	for _, g := range h.groups {
		names = append(names, g.name)
	}
	if len(names) != 2 || names[0] != "/lin/g0" || names[1] != "/lin/g1" {
		t.Fatalf("groups %v, want [/lin/g0 /lin/g1]", names)
	}
}

// Writes of unknown outcome whose values nobody saw are checked as never
// applied first; when a history needs one of them (a delete found the key
// it set), the whole history is checked again with them.
func TestUnobservedUnknownWrites(t *testing.T) {
	expectResult(t, "ok",
		set(1, 0, 10, "g/a", "seen").unknown(),
		get(2, 20, 30, "g/a", "seen"),
	)
	expectResult(t, "ok", // the unseen set is what the delete removed
		set(1, 0, 10, "g/a", "unseen").unknown(),
		del(2, 20, 30, "g/a", true),
	)
	expectResult(t, "ok", // seen through a compare_set's expected value
		set(1, 0, 10, "g/a", "x").unknown(),
		cas(2, 20, 30, "g/a", "x", "y", "y"),
	)
	expectResult(t, "illegal", // seen, then its value is gone without a write
		set(1, 0, 10, "g/a", "1"),
		set(2, 20, 30, "g/a", "2").unknown(),
		get(3, 40, 50, "g/a", "2"),
		get(3, 60, 70, "g/a", "1"),
	)
	// Many unseen unknown writes beside a busy client stay cheap.
	var ops []tOp
	for i := int64(0); i < 200; i++ {
		ops = append(ops, set(100+i, 10*i, 10*i+5, "g/a", fmt.Sprintf("lost-%d", i)).unknown())
		ops = append(ops, set(1, 10*i, 10*i+3, "g/b", fmt.Sprintf("v%d", i)))
		ops = append(ops, get(2, 10*i+4, 10*i+6, "g/b", fmt.Sprintf("v%d", i)))
	}
	expectResult(t, "ok", ops...)
}
