// cohortd's status page: polls /api/status and draws what it says. Every
// string from the server goes into the page as text (textContent), never
// as markup. A token, when cohortd asks for one, is kept in this tab's
// sessionStorage and sent only in the Authorization header of requests to
// this origin, never in a URL.
'use strict';

(function () {
  const POLL_MS = 1000;
  const MAX_BACKOFF_MS = 5000;
  const TOKEN_KEY = 'cohort.status.token';

  const $ = (id) => document.getElementById(id);
  let timer = null;
  let failures = 0;
  let inFlight = false;
  let memoryToken = '';  // When sessionStorage is off.

  // An element with attributes and children (strings become text nodes).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null) continue;
      if (name === 'class') node.className = value;
      else node.setAttribute(name, String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function age(ms) {
    if (ms < 1000) return (ms / 1000).toFixed(1) + ' s';
    if (ms < 120000) return Math.round(ms / 1000) + ' s';
    if (ms < 7200000) return Math.round(ms / 60000) + ' min';
    return (ms / 3600000).toFixed(1) + ' h';
  }

  function who(member) {
    let text = member.rank >= 0 ? 'rank ' + member.rank : member.name;
    if (member.host) text += ' (' + member.host + ')';
    return text;
  }

  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || '';
    } catch (e) {
      return '';
    }
  }

  function setToken(value) {
    try {
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch (e) {
      // Storage off: the token lives as long as this page.
    }
    memoryToken = value;
  }

  function connection(state, text) {
    const node = $('connection');
    node.dataset.state = state;
    node.textContent = text;
  }

  function runQuery() {
    const run = new URLSearchParams(location.search).get('run');
    return run ? '?run=' + encodeURIComponent(run) : '';
  }

  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(poll, ms);
  }

  async function poll() {
    if (inFlight) return;
    inFlight = true;
    const headers = {'Accept': 'application/json'};
    const t = token() || memoryToken;
    if (t) headers['Authorization'] = 'Bearer ' + t;
    try {
      const response = await fetch('/api/status' + runQuery(),
                                   {headers, cache: 'no-store'});
      let body = null;
      try {
        body = await response.json();
      } catch (e) {
        throw new Error('cohortd answered HTTP ' + response.status +
                        ' with no JSON');
      }
      if (response.status === 401 || response.status === 403) {
        if (response.status === 401 && t) setToken('');
        askForToken(body.error ? body.error.message : 'token refused', t);
        return;  // Polling resumes when a token is given.
      }
      if (!response.ok) {
        throw new Error(body.error ? body.error.message :
                                     'HTTP ' + response.status);
      }
      failures = 0;
      $('token-form').hidden = true;
      $('token-bar').hidden = !t;
      render(body);
      connection('live', 'live');
      schedule(POLL_MS);
    } catch (e) {
      failures += 1;
      connection('error', 'not updating: ' + e.message);
      schedule(Math.min(MAX_BACKOFF_MS, POLL_MS * (1 + failures)));
    } finally {
      inFlight = false;
    }
  }

  function askForToken(message, had) {
    connection('auth', had ? 'token refused' : 'token needed');
    $('token-form').hidden = false;
    $('token-bar').hidden = true;
    $('token-error').textContent = message;
    $('token').focus();
  }

  function render(s) {
    $('revision').textContent = s.revision;
    $('keys-part').hidden = s.keys === undefined;
    if (s.keys !== undefined) $('keys').textContent = s.keys;
    $('viewer').textContent = s.viewer;
    $('updated').textContent = 'Last update ' +
        new Date(s.time_unix_ms).toLocaleTimeString() + '.';

    const groups = new Map(s.groups.map((g) => [g.group, g]));
    const runs = s.runs.map((run) => {
      const group = groups.get(run.run);
      groups.delete(run.run);
      return renderRun(run, group);
    });
    if (s.runs_unlisted > 0) {
      runs.push(el('p', {class: 'more'}, 'and ' + s.runs_unlisted +
                   ' more runs (open ?run=RUN for one)'));
    }
    if (!s.coordinating) {
      runs.unshift(el('p', {class: 'more'},
          'This replica does not lead: runs and groups are on the leader.'));
    }
    $('runs').replaceChildren(...runs);
    $('runs-empty').hidden = s.runs.length > 0 || !s.coordinating;

    const rest = [...groups.values()].map((g) =>
        el('div', {class: 'card'}, renderGroup(g)));
    if (s.groups_unlisted > 0) {
      rest.push(el('p', {class: 'more'}, 'and ' + s.groups_unlisted +
                   ' more groups'));
    }
    $('groups').replaceChildren(...rest);
    $('groups-empty').hidden = rest.length > 0;
  }

  function renderRun(run, group) {
    const facts = el('p', {class: 'facts'},
        el('span', {class: 'badge phase-' + run.phase}, run.phase), ' ',
        'round ', el('b', {'data-field': 'round'}, run.round),
        ' · ', el('b', {}, run.num_nodes), ' nodes (min ', run.min_nodes,
        ', max ', run.max_nodes, ')',
        run.num_waiting > 0 ? [' · ', el('b', {}, run.num_waiting),
                               ' waiting for the next round'] : null,
        run.keys !== undefined ? [' · ', el('b', {}, run.keys), ' keys'] : null);
    const nodes = run.nodes.length === 0 ? null : el('table', {class: 'nodes'},
        el('thead', {}, el('tr', {},
            el('th', {class: 'num'}, 'node rank'), el('th', {}, 'node'),
            el('th', {}, 'address'), el('th', {class: 'num'}, 'workers'),
            el('th', {class: 'num'}, 'first rank'))),
        el('tbody', {}, run.nodes.map((n) => el('tr', {'data-node': n.node_id},
            el('td', {class: 'num'}, n.node_rank), el('td', {}, n.node_id),
            el('td', {class: 'mono'}, n.address),
            el('td', {class: 'num'}, n.local_world_size),
            el('td', {class: 'num'}, n.first_global_rank)))));
    return el('article', {class: 'card run', 'data-run': run.run},
        el('h3', {}, 'run ', el('span', {class: 'mono'}, run.run)),
        facts, nodes,
        run.nodes_unlisted > 0 ?
            el('p', {class: 'more'}, 'and ' + run.nodes_unlisted +
               ' more nodes') : null,
        group ? renderGroup(group) : null,
        run.diagnosis ? renderDiagnosis(run.diagnosis) : null);
  }

  function renderGroup(g) {
    const rows = g.members.map((m) => el('tr',
        {'data-member': m.name, 'data-state': m.state},
        el('td', {class: 'mono'}, m.name),
        el('td', {class: 'num'}, m.rank >= 0 ? m.rank : ''),
        el('td', {}, m.host),
        el('td', {}, el('span', {class: 'badge state-' + m.state,
                                 'data-field': 'state'}, m.state)),
        el('td', {class: 'num mono'}, m.incarnation),
        el('td', {class: 'num'}, age(m.last_heartbeat_ms_ago) + ' ago'),
        el('td', {}, m.message)));
    return el('section', {class: 'group', 'data-group': g.group},
        el('h4', {}, 'group ', g.group, ': ', g.members_alive, ' of ',
           g.members_total, ' members alive'),
        el('table', {class: 'members'},
            el('thead', {}, el('tr', {},
                el('th', {}, 'member'), el('th', {class: 'num'}, 'rank'),
                el('th', {}, 'host'), el('th', {}, 'state'),
                el('th', {class: 'num'}, 'incarnation'),
                el('th', {class: 'num'}, 'last heartbeat'),
                el('th', {}, 'why'))),
            el('tbody', {}, rows)),
        g.members_unlisted > 0 ?
            el('p', {class: 'more'}, 'and ' + g.members_unlisted +
               ' more members') : null,
        g.barriers.map(renderBarrier));
  }

  function renderBarrier(b) {
    const missing = b.missing.map(who);
    if (b.missing_unlisted > 0) missing.push('and ' + b.missing_unlisted +
                                             ' more');
    return el('div', {class: 'barrier', 'data-barrier': b.barrier},
        'barrier ', el('b', {class: 'mono'}, b.barrier),
        ' (generation ', b.generation, '): ', b.arrived, '/', b.participants,
        ' arrived, waiting ', age(b.waiting_ms), ' of ', age(b.timeout_ms),
        '; missing: ',
        el('span', {class: 'missing', 'data-field': 'missing'},
           missing.join(', ')));
  }

  function renderDiagnosis(d) {
    const parts = [el('h4', {}, 'flight records of round ', d.round,
                         ' (read ', new Date(d.as_of_unix_ms)
                             .toLocaleTimeString(), ')')];
    for (const g of d.groups) {
      const problems = g.findings.filter((f) => f.kind !== 'straggler');
      const stragglers = g.findings.filter((f) => f.kind === 'straggler');
      parts.push(el('div', {'data-flight-group': g.group},
          el('p', {class: 'facts'}, 'process group ', el('b', {}, g.group),
             ': ', g.ranks_dumped, ' ranks dumped'),
          problems.length === 0 ?
              el('p', {}, 'no problem found') :
              el('ul', {class: 'findings'}, problems.map((f) =>
                  el('li', {class: 'finding-' + f.kind,
                            'data-kind': f.kind}, f.sentence))),
          stragglers.length === 0 ? null : [
            el('h4', {}, 'stragglers'),
            el('ul', {class: 'stragglers'}, stragglers.map((f) =>
                el('li', {class: 'finding-straggler',
                          'data-kind': 'straggler'}, f.sentence)))]));
    }
    if (d.errors.length > 0) {
      parts.push(el('ul', {class: 'errors'},
                    d.errors.map((e) => el('li', {class: 'more'}, e))));
    }
    return el('div', {class: 'diagnosis'}, parts);
  }

  document.addEventListener('DOMContentLoaded', () => {
    $('token-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const value = $('token').value.trim();
      $('token').value = '';
      if (!value) return;
      setToken(value);
      $('token-error').textContent = '';
      connection('connecting', 'connecting…');
      schedule(0);
    });
    $('forget-token').addEventListener('click', () => {
      setToken('');
      schedule(0);
    });
    poll();
  });
})();
