package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
)

type opKind uint8

const (
	opSet opKind = iota
	opGet
	opCheck
	opAdd
	opCas
	opDelete
	opWait
	opMultiGet
	opMultiSet
	opAppend
	opTcpGet
	opTcpMultiGet
	numOpKinds
)

var opNames = [numOpKinds]string{
	"set", "get", "check", "add", "cas", "delete", "wait", "multi_get", "multi_set", "append",
	"tcp_get", "tcp_multi_get",
}

// How many keys and values each op takes: oneOrMore keys, or values as
// many as keys.
const (
	oneOrMore  = -1
	sameAsKeys = -1
)

var shapes = [numOpKinds]struct{ keys, values int }{
	opSet:      {1, 1},
	opGet:      {1, 0},
	opCheck:    {oneOrMore, 0},
	opAdd:      {1, 1},
	opCas:      {1, 2},
	opDelete:   {1, 0},
	opWait:     {oneOrMore, 0},
	opMultiGet: {oneOrMore, 0},
	opMultiSet: {oneOrMore, sameAsKeys},
	opAppend:   {1, 1},
	// The read half of PyTorch's TCPStore get and multi_get: its client
	// waits for the keys, then reads them in a second request, in which a
	// key deleted meanwhile reads as "".
	opTcpGet:      {1, 0},
	opTcpMultiGet: {oneOrMore, 0},
}

func (k opKind) String() string { return opNames[k] }

// readOnly ops change nothing: one whose outcome is unknown says nothing
// either, so it is dropped like a failed one.
func (k opKind) readOnly() bool {
	return k == opGet || k == opCheck || k == opWait || k == opMultiGet ||
		k == opTcpGet || k == opTcpMultiGet
}

// A result is what an op returned: str for get and cas, flag for check and
// delete, num for add, list for multi_get.
type result struct {
	str  string
	flag bool
	num  int64
	list []string
}

// A group is a key group ("g0" of "g0/a"): the unit the history is
// partitioned by. Its keys are numbered in the order they are first seen.
type group struct {
	name string
	keys []string
	ids  map[string]int
}

func (g *group) id(key string) int {
	id, ok := g.ids[key]
	if !ok {
		id = len(g.keys)
		g.ids[key] = id
		g.keys = append(g.keys, key)
	}
	return id
}

// An op is one operation of the history as the model sees it.
type op struct {
	kind    opKind
	g       *group
	keys    []string
	ids     []int // keys' indexes in g.keys
	vals    []string
	delta   int64 // add's
	unknown bool  // a write whose outcome is unknown: it may take effect at any time after call
	out     *result
	client  int64
	index   int // client's index among all clients, from 0, for the visualization
	call    int64
	ret     int64 // as recorded; the checker treats an unknown op's as +infinity
	file    string
	line    int
}

// A history is what the files hold, less the ops that cannot matter.
type history struct {
	ops     []*op
	groups  []*group // those with ops, by name
	files   int
	clients int
	dropped int   // failed ops, and read-only ops of unknown outcome
	unknown int   // writes of unknown outcome, kept
	start   int64 // the earliest call of any line, the origin of printed times
}

// line is one JSON line as written.
type line struct {
	Client *int64          `json:"client"`
	Op     *string         `json:"op"`
	Keys   []string        `json:"keys"`
	Values []string        `json:"values"`
	Call   *int64          `json:"call"`
	Return *int64          `json:"return"`
	Status *string         `json:"status"`
	Out    json.RawMessage `json:"out"`
}

// span is one client's time on one op, for the overlap check.
type span struct {
	client    int64
	call, ret int64
	where     string
}

// A reader collects the ops of several files into one history.
type reader struct {
	h       history
	groups  map[string]*group
	clients map[int64]int // index of each client, set in finish
	spans   []span
	started bool
}

func newReader() *reader { return &reader{groups: map[string]*group{}, clients: map[int64]int{}} }

// readHistory reads the given files. Any error is the input's fault.
func readHistory(paths []string) (*history, error) {
	r := newReader()
	for _, path := range paths {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		err = r.read(path, f)
		f.Close()
		if err != nil {
			return nil, err
		}
	}
	return r.finish()
}

func (r *reader) read(name string, in io.Reader) error {
	r.h.files++
	br := bufio.NewReaderSize(in, 1<<16)
	for n := 1; ; n++ {
		text, err := br.ReadBytes('\n')
		if len(bytes.TrimSpace(text)) > 0 {
			if perr := r.parse(name, n, text); perr != nil {
				return fmt.Errorf("%s:%d: %v", name, n, perr)
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: %v", name, err)
		}
	}
}

func (r *reader) parse(file string, n int, text []byte) error {
	var l line
	if err := json.Unmarshal(text, &l); err != nil {
		return fmt.Errorf("bad JSON: %v", err)
	}
	switch {
	case l.Client == nil:
		return fmt.Errorf("no client")
	case l.Op == nil:
		return fmt.Errorf("no op")
	case l.Call == nil:
		return fmt.Errorf("no call time")
	case l.Status == nil:
		return fmt.Errorf("no status")
	}
	kind, ok := parseKind(*l.Op)
	if !ok {
		return fmt.Errorf("unknown op %q (want one of %s)", *l.Op, strings.Join(opNames[:], ", "))
	}
	if err := checkShape(kind, l.Keys, l.Values); err != nil {
		return err
	}
	g, err := r.group(l.Keys)
	if err != nil {
		return err
	}
	o := &op{kind: kind, g: g, keys: l.Keys, vals: l.Values, client: *l.Client, call: *l.Call, file: file, line: n}
	r.clients[o.client] = 0
	if kind == opAdd {
		if o.delta, err = strconv.ParseInt(l.Values[0], 10, 64); err != nil {
			return fmt.Errorf("add's value %q is not a decimal int64", l.Values[0])
		}
	}
	if l.Return != nil {
		o.ret = *l.Return
		if o.ret < o.call {
			return fmt.Errorf("returns (%d) before its call (%d)", o.ret, o.call)
		}
		r.spans = append(r.spans, span{o.client, o.call, o.ret, fmt.Sprintf("%s:%d", file, n)})
	}
	if !r.started || o.call < r.h.start {
		r.h.start, r.started = o.call, true
	}

	switch *l.Status {
	case "ok":
		if l.Return == nil {
			return fmt.Errorf("status ok needs a return time")
		}
		if o.out, err = parseOut(kind, len(l.Keys), l.Out); err != nil {
			return err
		}
	case "unknown":
		if kind.readOnly() {
			r.h.dropped++
			return nil
		}
		o.unknown = true
		r.h.unknown++
	case "fail":
		r.h.dropped++
		return nil
	default:
		return fmt.Errorf("unknown status %q (want ok, unknown or fail)", *l.Status)
	}
	o.ids = make([]int, len(o.keys))
	for i, k := range o.keys {
		o.ids[i] = g.id(k)
	}
	r.h.ops = append(r.h.ops, o)
	return nil
}

func parseKind(name string) (opKind, bool) {
	for k, n := range opNames {
		if n == name {
			return opKind(k), true
		}
	}
	return 0, false
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func checkShape(kind opKind, keys, values []string) error {
	want := shapes[kind]
	wantValues := want.values
	if wantValues == sameAsKeys {
		wantValues = len(keys)
	}
	keysOK := len(keys) == want.keys || (want.keys == oneOrMore && len(keys) > 0)
	if keysOK && len(values) == wantValues {
		return nil
	}
	var takes string
	switch {
	case want.keys == oneOrMore && want.values == sameAsKeys:
		takes = "one or more keys and as many values"
	case want.keys == oneOrMore:
		takes = "one or more keys and no values"
	default:
		takes = fmt.Sprintf("%s and %s", plural(want.keys, "key"), plural(want.values, "value"))
	}
	return fmt.Errorf("%s takes %s, got %s and %s", kind, takes, plural(len(keys), "key"), plural(len(values), "value"))
}

// group returns the one group of keys, made on first sight.
func (r *reader) group(keys []string) (*group, error) {
	var name string
	for i, k := range keys {
		slash := strings.LastIndexByte(k, '/')
		if slash < 0 {
			return nil, fmt.Errorf("key %q has no group (want <group>/<name>)", k)
		}
		if i == 0 {
			name = k[:slash]
		} else if k[:slash] != name {
			return nil, fmt.Errorf("keys %q and %q are of different groups", keys[0], k)
		}
	}
	g := r.groups[name]
	if g == nil {
		g = &group{name: name, ids: map[string]int{}}
		r.groups[name] = g
	}
	return g, nil
}

// parseOut decodes an ok op's result; ops without one have none.
func parseOut(kind opKind, nkeys int, raw json.RawMessage) (*result, error) {
	var dst interface{}
	var want string
	res := &result{}
	switch kind {
	case opGet, opCas, opTcpGet:
		dst, want = &res.str, "a string"
	case opCheck, opDelete:
		dst, want = &res.flag, "a bool"
	case opAdd:
		dst, want = &res.num, "an int64"
	case opMultiGet, opTcpMultiGet:
		dst, want = &res.list, fmt.Sprintf("a list of %d strings", nkeys)
	default:
		return nil, nil
	}
	if len(raw) == 0 || string(raw) == "null" {
		return nil, fmt.Errorf("%s with status ok needs out (%s)", kind, want)
	}
	if err := json.Unmarshal(raw, dst); err != nil || ((kind == opMultiGet || kind == opTcpMultiGet) && len(res.list) != nkeys) {
		return nil, fmt.Errorf("%s's out %s is not %s", kind, raw, want)
	}
	return res, nil
}

// finish checks that no client ran two ops at once, numbers the clients
// and sorts the groups.
func (r *reader) finish() (*history, error) {
	sort.Slice(r.spans, func(i, j int) bool {
		a, b := r.spans[i], r.spans[j]
		if a.client != b.client {
			return a.client < b.client
		}
		return a.call < b.call || (a.call == b.call && a.ret < b.ret)
	})
	for i := 1; i < len(r.spans); i++ {
		a, b := r.spans[i-1], r.spans[i]
		if a.client == b.client && b.call < a.ret {
			return nil, fmt.Errorf("client %d has two operations at once: %s [%d, %d] and %s [%d, %d]",
				a.client, a.where, a.call, a.ret, b.where, b.call, b.ret)
		}
	}
	ids := make([]int64, 0, len(r.clients))
	for c := range r.clients {
		ids = append(ids, c)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	for i, c := range ids {
		r.clients[c] = i
	}
	for _, o := range r.h.ops {
		o.index = r.clients[o.client]
	}
	r.h.clients = len(ids)
	// A group all of whose ops were dropped has no keys and no partition.
	for _, g := range r.groups {
		if len(g.keys) > 0 {
			r.h.groups = append(r.h.groups, g)
		}
	}
	sort.Slice(r.h.groups, func(i, j int) bool { return r.h.groups[i].name < r.h.groups[j].name })
	return &r.h, nil
}
