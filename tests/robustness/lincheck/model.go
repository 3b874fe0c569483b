package main

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/anishathalye/porcupine"
)

// A slot is one key's value; h is a hash of the key's index and the value,
// 0 when the key is missing.
type slot struct {
	val string
	h   uint64
	set bool
}

// A kv is the store's state in one key group: each key's slot, by its index
// in the group; slots past the end are missing keys, so the empty kv is the
// initial state of every group. A kv never changes once made (porcupine
// keeps states in its cache): a write copies the slots, and updates hash,
// the sum of the slots' h, without rehashing the untouched values.
type kv struct {
	g    *group
	vals []slot
	hash uint64
}

var emptyKV = &kv{}

func slotHash(id int, v string) uint64 {
	h := uint64(14695981039346656037) // FNV-1a
	for i := 0; i < len(v); i++ {
		h ^= uint64(v[i])
		h *= 1099511628211
	}
	h ^= uint64(id+1) * 0x9e3779b97f4a7c15
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	return h | 1 // a present key never hashes like a missing one
}

func (s *kv) get(id int) slot {
	if id < len(s.vals) {
		return s.vals[id]
	}
	return slot{}
}

// edit returns a copy of s to write to, with room for all of g's keys.
func (s *kv) edit(g *group) *kv {
	vals := make([]slot, len(g.keys))
	copy(vals, s.vals)
	return &kv{g: g, vals: vals, hash: s.hash}
}

func (s *kv) put(id int, v string) {
	h := slotHash(id, v)
	s.hash += h - s.vals[id].h
	s.vals[id] = slot{val: v, h: h, set: true}
}

func (s *kv) remove(id int) {
	s.hash -= s.vals[id].h
	s.vals[id] = slot{}
}

func equalKV(a, b *kv) bool {
	if a == b {
		return true
	}
	if a.hash != b.hash {
		return false
	}
	n := len(a.vals)
	if len(b.vals) > n {
		n = len(b.vals)
	}
	for i := 0; i < n; i++ {
		x, y := a.get(i), b.get(i)
		if x.h != y.h || x.set != y.set || x.val != y.val {
			return false
		}
	}
	return true
}

// eval runs in on s as the store would: what it returns, the state after,
// and whether it can complete from s at all (a blocking read waits while a
// key is missing; add fails on a value that is not a number).
func eval(s *kv, in *op) (res result, next *kv, can bool) {
	next = s
	switch in.kind {
	case opSet:
		next = s.edit(in.g)
		next.put(in.ids[0], in.vals[0])
	case opAppend:
		cur := s.get(in.ids[0]).val
		next = s.edit(in.g)
		next.put(in.ids[0], cur+in.vals[0])
	case opMultiSet:
		next = s.edit(in.g)
		for i, id := range in.ids {
			next.put(id, in.vals[i])
		}
	case opGet:
		cur := s.get(in.ids[0])
		if !cur.set {
			return res, s, false
		}
		res.str = cur.val
	case opTcpGet:
		res.str = s.get(in.ids[0]).val // "" when missing
	case opTcpMultiGet:
		res.list = make([]string, len(in.ids))
		for i, id := range in.ids {
			res.list[i] = s.get(id).val
		}
	case opCheck:
		res.flag = true
		for _, id := range in.ids {
			if !s.get(id).set {
				res.flag = false
				break
			}
		}
	case opWait:
		for _, id := range in.ids {
			if !s.get(id).set {
				return res, s, false
			}
		}
	case opMultiGet:
		res.list = make([]string, len(in.ids))
		for i, id := range in.ids {
			cur := s.get(id)
			if !cur.set {
				return res, s, false
			}
			res.list[i] = cur.val
		}
	case opAdd:
		cur := s.get(in.ids[0])
		var n int64
		if cur.set {
			var err error
			if n, err = strconv.ParseInt(cur.val, 10, 64); err != nil {
				return res, s, false
			}
		}
		res.num = n + in.delta
		next = s.edit(in.g)
		next.put(in.ids[0], strconv.FormatInt(res.num, 10))
	case opCas:
		cur := s.get(in.ids[0])
		expected, desired := in.vals[0], in.vals[1]
		switch {
		case !cur.set && expected != "":
			res.str = expected
		case !cur.set || cur.val == expected:
			res.str = desired
			next = s.edit(in.g)
			next.put(in.ids[0], desired)
		default:
			res.str = cur.val
		}
	case opDelete:
		cur := s.get(in.ids[0])
		res.flag = cur.set
		if cur.set {
			next = s.edit(in.g)
			next.remove(in.ids[0])
		}
	}
	return res, next, true
}

func sameResult(kind opKind, a, b *result) bool {
	switch kind {
	case opGet, opCas, opTcpGet:
		return a.str == b.str
	case opCheck, opDelete:
		return a.flag == b.flag
	case opAdd:
		return a.num == b.num
	case opMultiGet, opTcpMultiGet:
		if len(a.list) != len(b.list) {
			return false
		}
		for i := range a.list {
			if a.list[i] != b.list[i] {
				return false
			}
		}
	}
	return true
}

// step is the model's transition. An op of unknown outcome returns
// anything; its effect is applied where the checker places it, and the
// checker may place it after every other op (its return is +infinity),
// which is the same as never applying it.
func step(state, input, output interface{}) (bool, interface{}) {
	s, in := state.(*kv), input.(*op)
	res, next, can := eval(s, in)
	if in.unknown {
		return true, next // when !can, next is s: an add that failed changed nothing
	}
	if !can {
		return false, nil
	}
	if out, _ := output.(*result); out != nil && !sameResult(in.kind, &res, out) {
		return false, nil
	}
	return true, next
}

// quote shows a value, cut short when long.
func quote(v string) string {
	const max = 40
	if len(v) > max {
		return strconv.Quote(v[:max-3]) + "..."
	}
	return strconv.Quote(v)
}

func describeResult(kind opKind, r *result) string {
	switch kind {
	case opGet, opCas, opTcpGet:
		return quote(r.str)
	case opCheck, opDelete:
		return strconv.FormatBool(r.flag)
	case opAdd:
		return strconv.FormatInt(r.num, 10)
	case opMultiGet, opTcpMultiGet:
		q := make([]string, len(r.list))
		for i, v := range r.list {
			q[i] = quote(v)
		}
		return "[" + strings.Join(q, " ") + "]"
	}
	return ""
}

// describeOp shows an op with its arguments and its result, if any.
func describeOp(in *op, out *result) string {
	var b strings.Builder
	b.WriteString(in.kind.String())
	switch in.kind {
	case opMultiSet:
		for i, k := range in.keys {
			fmt.Fprintf(&b, " %s=%s", k, quote(in.vals[i]))
		}
	case opAdd:
		fmt.Fprintf(&b, " %s %+d", in.keys[0], in.delta)
	default:
		for _, k := range in.keys {
			b.WriteString(" " + k)
		}
		for _, v := range in.vals {
			b.WriteString(" " + quote(v))
		}
	}
	switch {
	case in.unknown && hasResult(in.kind):
		b.WriteString(" -> ? (outcome unknown)")
	case in.unknown:
		b.WriteString(" (outcome unknown)")
	case out != nil:
		b.WriteString(" -> " + describeResult(in.kind, out))
	}
	return b.String()
}

func hasResult(kind opKind) bool {
	switch kind {
	case opGet, opCas, opCheck, opDelete, opAdd, opMultiGet, opTcpGet, opTcpMultiGet:
		return true
	}
	return false
}

func describeState(s *kv) string {
	if s.g == nil {
		return "{}"
	}
	var present []int
	for i, sl := range s.vals {
		if sl.set {
			present = append(present, i)
		}
	}
	sort.Slice(present, func(i, j int) bool { return s.g.keys[present[i]] < s.g.keys[present[j]] })
	parts := make([]string, len(present))
	for i, id := range present {
		parts[i] = s.g.keys[id] + "=" + quote(s.vals[id].val)
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// whyNot says what becomes of in if it comes next from s: why it cannot,
// or that it can but leads nowhere (the search has been there).
func whyNot(s *kv, in *op, out *result) string {
	res, _, can := eval(s, in)
	switch {
	case in.unknown:
		return "it may take effect here or later, or never; no choice leads anywhere"
	case !can && in.kind == opAdd:
		return fmt.Sprintf("%s holds %s, not a number", in.keys[0], quote(s.get(in.ids[0]).val))
	case !can:
		var missing []string
		for i, id := range in.ids {
			if !s.get(id).set {
				missing = append(missing, in.keys[i])
			}
		}
		return fmt.Sprintf("it would block: %s missing", strings.Join(missing, ", "))
	case out != nil && !sameResult(in.kind, &res, out):
		return "the store would return " + describeResult(in.kind, &res)
	}
	return "it fits here, but no order of the rest does"
}

// newModel is the c10d store's model. With byGroup, porcupine partitions
// the history by key group, in the order the groups first appear. Once g
// (if any) trips, no op steps.
func newModel(byGroup bool, g *guard) porcupine.Model {
	stepFn := step
	if g != nil {
		stepFn = func(state, input, output interface{}) (bool, interface{}) {
			if g.tripped.Load() {
				return false, nil
			}
			return step(state, input, output)
		}
	}
	m := porcupine.Model{
		Init:  func() interface{} { return emptyKV },
		Step:  stepFn,
		Equal: func(a, b interface{}) bool { return equalKV(a.(*kv), b.(*kv)) },
		Hash:  func(s interface{}) uint64 { return s.(*kv).hash },
		DescribeOperation: func(input, output interface{}) string {
			out, _ := output.(*result)
			return describeOp(input.(*op), out)
		},
		DescribeState: func(s interface{}) string { return describeState(s.(*kv)) },
		DescribeOperationMetadata: func(m interface{}) string {
			o, ok := m.(*op)
			if !ok {
				return ""
			}
			return fmt.Sprintf("client %d, %s:%d", o.client, o.file, o.line)
		},
	}
	if byGroup {
		m.Partition = partitionByGroup
	}
	return m
}

func partitionByGroup(ops []porcupine.Operation) [][]porcupine.Operation {
	var parts [][]porcupine.Operation
	index := map[*group]int{}
	for _, o := range ops {
		g := o.Input.(*op).g
		i, ok := index[g]
		if !ok {
			i = len(parts)
			index[g] = i
			parts = append(parts, nil)
		}
		parts[i] = append(parts[i], o)
	}
	return parts
}
