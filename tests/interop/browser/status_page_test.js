// The browser side of tests/interop/status_page_test.sh: Debian's chromium,
// driven by playwright-core, looks at cohortd's status page as a user
// would. Every wait is for a state, with a deadline far above what it
// should take (a loaded 2-core machine), never a timing assertion.
//
// Environment: PLAYWRIGHT_CORE, CHROMIUM, OUT_DIR (screenshots), OPEN_URL
// (a cohortd without auth running run "demo"), VICTIM_PID (member m3's
// process), AUTH_URL (a cohortd with auth running runs "demo" and
// "other"), ADMIN_TOKEN, RUN_TOKEN (run demo's).
'use strict';

const path = require('path');
const {chromium} = require(process.env.PLAYWRIGHT_CORE);

const WAIT_MS = 90000;
const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error('$' + name + ' is not set');
  return value;
};

let failures = 0;
function check(ok, what) {
  if (ok) {
    console.log('ok: ' + what);
  } else {
    failures += 1;
    console.log('FAIL: ' + what);
  }
}

// Waits until `predicate(arg)` holds in the page; says what it waited for.
async function waitInPage(page, what, predicate, arg) {
  try {
    await page.waitForFunction(predicate, arg,
                               {timeout: WAIT_MS, polling: 200});
    console.log('ok: ' + what);
  } catch (e) {
    failures += 1;
    console.log('FAIL: ' + what + ' (not seen within ' + WAIT_MS / 1000 +
                ' s): ' + e.message.split('\n')[0]);
  }
}

const text = async (page, selector) =>
  (await page.locator(selector).first().textContent({timeout: WAIT_MS}))
      .replace(/\s+/g, ' ');

// Every request the page makes must go to cohortd itself, and never carry
// a token in its URL; no script error and no CSP violation.
function watch(page, origin, secrets) {
  const problems = [];
  page.on('request', (r) => {
    if (!r.url().startsWith(origin + '/')) {
      problems.push('request outside cohortd: ' + r.url());
    }
    for (const s of secrets) {
      if (r.url().includes(s)) problems.push('a token in a URL: ' + r.url());
    }
  });
  page.on('pageerror', (e) => problems.push('script error: ' + e.message));
  page.on('console', (m) => {
    // A 401 or 403 that the page asked for is not an error of the page.
    if (m.type() === 'error' && !/status of 40[13]/.test(m.text())) {
      problems.push('console error: ' + m.text());
    }
  });
  return problems;
}

async function openCohortd(browser) {
  const url = env('OPEN_URL');
  const origin = new URL(url).origin;
  const page = await browser.newPage({viewport: {width: 1280, height: 900}});
  const problems = watch(page, origin, []);
  await page.goto(url);

  await waitInPage(page, 'the page is live',
      () => document.getElementById('connection').dataset.state === 'live');
  await waitInPage(page, 'run demo appears with its two nodes',
      () => document.querySelectorAll(
          'article[data-run="demo"] tr[data-node]').length === 2);
  const run = await text(page, 'article[data-run="demo"] .facts');
  check(/COMPLETE/.test(run) && /round 0/.test(run) && /2 nodes/.test(run),
        'run demo is COMPLETE, round 0, 2 nodes: "' + run + '"');
  const nodeB = await text(page, 'tr[data-node="node-b"]');
  check(/10\.0\.0\.2:29400/.test(nodeB), 'node-b\'s address: "' + nodeB + '"');

  await waitInPage(page, 'members m0-m3 are alive',
      () => ['m0', 'm1', 'm2', 'm3'].every((m) => {
        const row = document.querySelector('tr[data-member="' + m + '"]');
        return row && row.dataset.state === 'alive';
      }));
  await waitInPage(page, 'barrier init names rank 2 as missing',
      () => {
        const missing = document.querySelector(
            '[data-barrier="init"] [data-field="missing"]');
        return missing && missing.textContent === 'rank 2 (host-b)';
      });
  const barrier = await text(page, '[data-barrier="init"]');
  check(/2\/3 arrived/.test(barrier), 'barrier init: 2/3 arrived: "' +
        barrier + '"');
  await waitInPage(page, 'run hang\'s diagnosis names rank 1 as behind',
      () => {
        const hang = document.querySelector(
            'article[data-run="hang"] [data-kind="hang"]');
        return hang && hang.textContent.includes(
            'rank 1 last completed #1 and has not entered #2');
      });

  // kill -9 of a member: its row turns failed once its lease runs out.
  process.kill(Number(env('VICTIM_PID')), 'SIGKILL');
  console.log('killed m3 (pid ' + env('VICTIM_PID') + ') with SIGKILL');
  await waitInPage(page, 'm3 turns failed',
      () => {
        const row = document.querySelector('tr[data-member="m3"]');
        return row && row.dataset.state === 'failed';
      });
  const m3 = await text(page, 'tr[data-member="m3"]');
  check(/failed/.test(m3) && /no heartbeat for 600ms/.test(m3),
        'm3\'s row says why: "' + m3 + '"');
  const alive = await page.$$eval(
      'article[data-run="demo"] tr[data-member][data-state="alive"]',
                                  (rows) => rows.map((r) => r.dataset.member));
  check(alive.join(',') === 'm0,m1,m2', 'm0-m2 stay alive: ' + alive);
  const missing = await text(page,
                             '[data-barrier="init"] [data-field="missing"]');
  check(missing === 'rank 2 (host-b)', 'barrier init still waits for rank 2');

  await page.screenshot({path: path.join(env('OUT_DIR'), 'status_page.png'),
                         fullPage: true});
  check(problems.length === 0, 'no request outside cohortd, no script ' +
        'error: ' + JSON.stringify(problems));
  await page.close();
}

async function authCohortd(browser) {
  const url = env('AUTH_URL');
  const origin = new URL(url).origin;
  const admin = env('ADMIN_TOKEN');
  const runToken = env('RUN_TOKEN');

  // The API over plain HTTP: what each token gets, and bad requests.
  const get = (p, token, init) => fetch(origin + p, {
    ...init,
    headers: token ? {Authorization: 'Bearer ' + token} : {},
  });
  let r = await get('/api/status');
  check(r.status === 401 &&
        r.headers.get('www-authenticate') === 'Bearer realm="cohortd"',
        'no token: 401 with WWW-Authenticate (' + r.status + ')');
  r = await get('/api/status', 'not-a-token-cohortd-knows');
  const refused = await r.json();
  check(r.status === 401 && /token refused/.test(refused.error.message) &&
        !JSON.stringify(refused).includes('not-a-token'),
        'an unknown token: 401, not quoted: ' + JSON.stringify(refused));
  r = await get('/api/status', admin);
  const all = await r.json();
  check(r.status === 200 && all.runs.map((x) => x.run).join() === 'demo,other',
        'the admin sees runs demo and other');
  r = await get('/api/status', runToken);
  const mine = await r.json();
  check(r.status === 200 && mine.runs.map((x) => x.run).join() === 'demo' &&
        mine.keys === undefined, 'demo\'s token sees demo alone');
  r = await get('/api/status?run=other', runToken);
  check(r.status === 403, 'demo\'s token asking for other: 403 (' +
        r.status + ')');
  r = await get('/api/status?run=a%2Fb', admin);
  check(r.status === 400, 'a bad run name: 400 (' + r.status + ')');
  r = await get('/api/status?run=nope', admin);
  check(r.status === 404, 'an unknown run: 404 (' + r.status + ')');
  r = await get('/nope', admin);
  check(r.status === 404, 'an unknown path: 404 (' + r.status + ')');
  r = await get('/api/status', admin, {method: 'POST'});
  check(r.status === 405, 'POST: 405 (' + r.status + ')');

  // The page asks for a token, refuses a bad one, shows demo for demo's.
  const page = await browser.newPage({viewport: {width: 1280, height: 700}});
  const problems = watch(page, origin, [admin, runToken]);
  await page.goto(url);
  await page.waitForSelector('#token-form', {state: 'visible',
                                             timeout: WAIT_MS});
  check(true, 'the page asks for a token');
  await page.fill('#token', 'not-a-token-cohortd-knows');
  await page.click('#token-form button[type="submit"]');
  await waitInPage(page, 'a bad token is refused',
      () => /token refused/.test(
          document.getElementById('token-error').textContent));
  await page.fill('#token', runToken);
  await page.click('#token-form button[type="submit"]');
  await waitInPage(page, 'demo\'s token shows run demo',
      () => document.querySelector('article[data-run="demo"]') !== null);
  check(await page.locator('article[data-run="other"]').count() === 0,
        'and not run other');
  check(await page.locator('#keys-part').isHidden(),
        'and not the count of every key');
  await page.screenshot({path: path.join(env('OUT_DIR'),
                                         'status_page_auth.png'),
                         fullPage: true});
  check(problems.length === 0, 'no request outside cohortd, no token in a ' +
        'URL, no script error: ' + JSON.stringify(problems));
  await page.close();
}

(async () => {
  const browser = await chromium.launch({executablePath: env('CHROMIUM')});
  try {
    console.log('chromium ' + browser.version());
    await openCohortd(browser);
    await authCohortd(browser);
  } finally {
    await browser.close();
  }
  if (failures > 0) {
    console.log(failures + ' check(s) failed');
    process.exit(1);
  }
  console.log('every browser check passed');
})().catch((e) => {
  console.log('FAIL: ' + (e.stack || e));
  process.exit(1);
});
