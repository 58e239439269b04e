// The web console in real headless Chromium (issue 15), driven by
// playwright-core. Run by tests/it/console/browser.rs, which starts the
// appliance, makes the people, the agent's token and the plans, and reads
// the JSON report this script writes; it is not meant to be run alone.
//
// Environment (all set by the Rust test):
//   CUBE_URL            https://127.0.0.1:PORT
//   CUBE_SPKI           base64 SHA-256 of the server certificate's
//                       SubjectPublicKeyInfo: the one key Chromium accepts
//   NODE_EXTRA_CA_CERTS the appliance's CA (for this script's own /v1 calls)
//   CUBE_CHROMIUM       the browser (default /usr/bin/chromium)
//   CUBE_PASSWORD       the people's password
//   CUBE_APPROVER, CUBE_SECOND_APPROVER, CUBE_AUDITOR, CUBE_ADMIN  names
//   CUBE_AGENT_TOKEN    the agent's bearer token (plans are submitted with it)
//   CUBE_PLAN, CUBE_PLAN2  two plans pending approval (of CUBE_APPROVER's tenant)
//   CUBE_TRUST_BEFORE   a deploy plan two people approved
//   CUBE_TRUST_DIFF     the same but one risky value, pending (needs two approvals)
//   CUBE_TRUST_HIDDEN   a deploy plan with hidden characters and a homoglyph
//   CUBE_OUT            a directory for the report, downloads and page sources
//   CUBE_SCREENS        where screenshots go (target/console-screens)
//   CUBE_DOC_SCREENS    if set, the few commit-ready screenshots are also
//                       written there (docs/console)
//
// Exit status 0 only if every step passed. Steps for pages that do not
// exist yet (a 404) are reported in `skipped`; the Rust test decides.

import { mkdirSync, writeFileSync, copyFileSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const env = (k, d) => {
  const v = process.env[k] ?? d;
  if (v === undefined) throw new Error(`${k} is not set`);
  return v;
};
const BASE = env('CUBE_URL');
const PASSWORD = env('CUBE_PASSWORD');
const APPROVER = env('CUBE_APPROVER');
const SECOND = env('CUBE_SECOND_APPROVER');
const AUDITOR = env('CUBE_AUDITOR');
const ADMIN = env('CUBE_ADMIN');
const AGENT = env('CUBE_AGENT_TOKEN');
const PLAN = env('CUBE_PLAN');
const PLAN2 = env('CUBE_PLAN2');
const TRUST_BEFORE = env('CUBE_TRUST_BEFORE');
const TRUST_DIFF = env('CUBE_TRUST_DIFF');
const TRUST_HIDDEN = env('CUBE_TRUST_HIDDEN');
const OUT = env('CUBE_OUT');
const SCREENS = env('CUBE_SCREENS');
const DOC_SCREENS = process.env.CUBE_DOC_SCREENS || '';

mkdirSync(OUT, { recursive: true });
mkdirSync(join(OUT, 'pages'), { recursive: true });
mkdirSync(SCREENS, { recursive: true });
if (DOC_SCREENS) mkdirSync(DOC_SCREENS, { recursive: true });

const report = {
  ok: false,
  browser: '',
  steps: [],
  skipped: [],
  problems: [], // console errors, page errors, CSP violations, failed requests
  screenshots: [],
  pages: [], // saved page sources: {name, file}
  focus: {},
  phone_overflow: [], // pages wider than a phone's screen
  desktop_overflow: [], // tables that do not fit at 1280 px
  auditor_refused: null, // the code the auditor's forged decision got
  trust: {}, // issue #36: the notification link's actions, Approve's place
  task_ref: null,
  receipt_file: null,
  csv_file: null,
  error: null,
};
const step = (s) => {
  report.steps.push(s);
  process.stderr.write(`browser: ${s}\n`);
};
const must = (cond, what) => {
  if (!cond) throw new Error(`check failed: ${what}`);
};
class Missing extends Error {}

const DESKTOP = { width: 1280, height: 800 };
const PHONE = { width: 390, height: 844 };
// Which screenshots go to docs/console (few, small).
const FOR_DOCS = new Set([
  'sign-in-desktop', 'overview-desktop', 'approvals-desktop', 'plan-review-desktop',
  'task-desktop', 'receipt-verify-desktop', 'audit-desktop', 'leases-desktop', 'identities-desktop',
  'approvals-phone', 'plan-review-phone', 'overview-dark', 'plan-changed-desktop', 'plan-hidden-desktop', 'confirm-phone',
]);

const browser = await chromium.launch({
  executablePath: process.env.CUBE_CHROMIUM || '/usr/bin/chromium',
  headless: true,
  chromiumSandbox: false, // root on CI: Chromium's sandbox needs a user
  args: [
    '--disable-gpu',
    '--disable-quic',
    '--no-first-run',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
    '--disable-dev-shm-usage',
    // Trust exactly the appliance's key, nothing else.
    `--ignore-certificate-errors-spki-list=${env('CUBE_SPKI')}`,
  ],
});
report.browser = browser.version();

/** A new context whose pages report console errors, page errors and failed requests. */
async function context(name, opts = {}) {
  const ctx = await browser.newContext({
    baseURL: BASE,
    viewport: DESKTOP,
    deviceScaleFactor: 1,
    acceptDownloads: true,
    ...opts,
  });
  ctx.on('page', (p) => watch(p, name));
  return ctx;
}
function watch(page, name) {
  page.on('console', (m) => {
    // "Failed to load resource" repeats an error answer, checked below;
    // except Chromium's own /favicon.ico (no page asks for it, and the
    // appliance has none: a 404 outside /console).
    if (m.text().startsWith('Failed to load resource')) {
      const at = m.location().url || '';
      if (!at.startsWith(BASE) || new URL(at).pathname !== '/favicon.ico') seen404.push(at);
      return;
    }
    if (m.type() === 'error' || m.type() === 'warning') {
      report.problems.push({ context: name, url: page.url(), kind: `console ${m.type()}`, text: m.text() });
    }
  });
  page.on('pageerror', (e) => report.problems.push({ context: name, url: page.url(), kind: 'page error', text: String(e) }));
  page.on('requestfailed', (r) => {
    // A download ends its navigation as "aborted": not a failure.
    const f = r.failure()?.errorText ?? '';
    if (f.includes('ERR_ABORTED') && r.isNavigationRequest()) return;
    report.problems.push({ context: name, url: r.url(), kind: 'request failed', text: f });
  });
  page.on('response', (r) => {
    if (r.request().isNavigationRequest() && r.frame() === page.mainFrame()) documents.set(page, r);
    if (r.status() < 400) return;
    const key = `${r.request().method()} ${new URL(r.url()).pathname} ${r.status()}`;
    if (expected.has(key)) return;
    report.problems.push({ context: name, url: r.url(), kind: 'error answer', text: key });
  });
}
const seen404 = []; // (debug) what "Failed to load resource" named
// Each page's last document as the server sent it (not the live DOM).
const documents = new WeakMap();
// Error answers a step asks for on purpose.
const expected = new Set(['POST /console/sign-in 401']);

/** Go to a console path; a 404 means the page is not built yet. */
async function open(page, path, what) {
  const r = await page.goto(path);
  if (r && r.status() === 404) throw new Missing(`${what}: ${path} answers 404 (page missing)`);
  must(r && r.ok(), `${what}: ${path} answers ${r && r.status()}`);
  return r;
}

/** Keep the page's HTML as the server sent it, for the Rust side's checks. */
async function save(page, name) {
  const doc = documents.get(page);
  must(doc && doc.url() === page.url(), `${name}: the document of ${page.url()}`);
  const file = join(OUT, 'pages', `${name}.html`);
  writeFileSync(file, await doc.text());
  report.pages.push({ name, file });
}

// Long pages are cut at this height: the top says what the page is.
const MAX_HEIGHT = 1200;

async function shot(page, name) {
  const file = join(SCREENS, `${name}.png`);
  const { width } = page.viewportSize();
  const height = Math.min(MAX_HEIGHT, await page.evaluate(() => document.documentElement.scrollHeight));
  const png = await page.screenshot({ path: file, fullPage: true, clip: { x: 0, y: 0, width, height }, animations: 'disabled' });
  report.screenshots.push({ name, file, bytes: png.length });
  if (DOC_SCREENS && FOR_DOCS.has(name)) {
    copyFileSync(file, join(DOC_SCREENS, `${name}.png`));
  }
}

/** Screenshots of a page as people see it: desktop, a phone's width, and
 * the dark scheme (desktop and phone). Every page is checked at the phone's
 * width: nothing may make the whole page scroll sideways. */
async function shots(page, name) {
  for (const scheme of ['light', 'dark']) {
    await page.emulateMedia({ colorScheme: scheme });
    const suffix = scheme === 'dark' ? '-dark' : '';
    await page.setViewportSize(DESKTOP);
    await shot(page, `${name}-desktop${suffix}`);
    await page.setViewportSize(PHONE);
    await shot(page, `${name}-phone${suffix}`);
    const wide = await page.evaluate(() => document.documentElement.scrollWidth);
    if (wide > PHONE.width) report.phone_overflow.push(`${name}: ${wide}px wide at ${PHONE.width}px`);
  }
  // At 1280 px, no table is clipped or needs scrolling sideways.
  await page.setViewportSize(DESKTOP);
  const clipped = await page.evaluate(() =>
    Array.from(document.querySelectorAll('.table-wrap'))
      .filter((w) => w.scrollWidth > w.clientWidth + 1)
      .map((w) => `${w.querySelector('caption, th')?.textContent?.trim() ?? 'a table'}: ${w.scrollWidth}px in ${w.clientWidth}px`));
  for (const c of clipped) report.desktop_overflow.push(`${name}: ${c}`);
  await page.emulateMedia({ colorScheme: 'light' });
  await page.setViewportSize(DESKTOP);
}

/** The focused element, described: `input#name`, `button[approve]`, `a:Overview`. */
const focused = (page) =>
  page.evaluate(() => {
    const e = document.activeElement;
    if (!e || e === document.body) return 'body';
    const tag = e.tagName.toLowerCase();
    if (e.id) return `${tag}#${e.id}`;
    if (tag === 'button') return `button[${e.value || e.textContent.trim()}]`;
    if (tag === 'a') return `a:${e.textContent.trim()}`;
    return tag;
  });

/** Press Tab until `want` has focus: the list of what had focus on the way. */
async function tabTo(page, want, max = 60) {
  const seen = [await focused(page)];
  for (let i = 0; i < max && seen[seen.length - 1] !== want; i++) {
    await page.keyboard.press('Tab');
    seen.push(await focused(page));
  }
  must(seen[seen.length - 1] === want, `Tab reaches ${want}: ${seen.join(' → ')}`);
  return seen;
}

async function signIn(page, name, { keyboard = false } = {}) {
  await open(page, '/console/sign-in', 'sign-in');
  if (keyboard) {
    // The keyboard alone: the name field, the password, the button.
    const order = await tabTo(page, 'input#name');
    await page.keyboard.type(name);
    await page.keyboard.press('Tab');
    must((await focused(page)) === 'input#password', 'Tab from the name goes to the password');
    await page.keyboard.type(PASSWORD);
    await page.keyboard.press('Tab');
    must((await focused(page)) === 'button[Sign in]', 'Tab from the password goes to Sign in');
    report.focus.sign_in = [...order, 'input#password', 'button[Sign in]'];
    await Promise.all([page.waitForURL(`${BASE}/console`), page.keyboard.press('Enter')]);
  } else {
    await page.getByLabel('User name').fill(name);
    await page.getByLabel('Password').fill(PASSWORD);
    await Promise.all([page.waitForURL(`${BASE}/console`), page.getByRole('button', { name: 'Sign in' }).click()]);
  }
  must((await page.locator('h1').innerText()) === 'Overview', `${name} lands on the Overview`);
}

/** The agent's own /v1 calls (bearer token; the CA from NODE_EXTRA_CA_CERTS). */
async function v1(method, path, body) {
  const r = await fetch(`${BASE}${path}`, {
    method,
    headers: { authorization: `Bearer ${AGENT}`, 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const v = await r.json();
  return [r.status, v];
}

/** Run a stage; a missing page makes it "skipped", anything else fails the run. */
async function stage(name, fn) {
  try {
    await fn();
    step(`${name}: done`);
  } catch (e) {
    if (e instanceof Missing) {
      report.skipped.push(`${name}: ${e.message}`);
      step(`${name}: skipped (${e.message})`);
    } else {
      throw new Error(`${name}: ${e.message}`, { cause: e });
    }
  }
}

let alice; // the approver's context, signed in
let page; // its page
let auditor; // the auditor's page, signed in

try {
  // --- 1. sign-in, the queue, the review, approve (JavaScript on) --------
  await stage('approve', async () => {
    alice = await context('approver');
    page = await alice.newPage();
    // Signed out: the console sends to the sign-in form.
    await page.goto('/console');
    must(page.url() === `${BASE}/console/sign-in`, `signed out, /console goes to sign-in (${page.url()})`);
    await shots(page, 'sign-in');
    await save(page, 'sign-in');
    // A wrong password: the form again, with a message.
    await page.getByLabel('User name').fill(APPROVER);
    await page.getByLabel('Password').fill('not the password');
    await page.getByRole('button', { name: 'Sign in' }).click();
    must(await page.getByRole('alert').innerText().then((t) => t.includes('Wrong user name or password')), 'a wrong password is refused');
    await signIn(page, APPROVER, { keyboard: true });
    await shots(page, 'overview');
    await save(page, 'overview');

    await Promise.all([page.waitForURL(`${BASE}/console/approvals`), page.getByRole('link', { name: 'Approvals', exact: true }).click()]);
    const link = page.getByRole('link', { name: PLAN, exact: true });
    must((await link.count()) === 1, `the queue lists ${PLAN}`);
    await shots(page, 'approvals');
    await save(page, 'approvals');

    await Promise.all([page.waitForURL(`${BASE}/console/plans/${PLAN}`), link.click()]);
    const command = await page.locator('pre.command').innerText();
    must(command.includes('/bin/sh -c'), `the review shows the command: ${command}`);
    must((await page.locator('.state-name').innerText()) === 'pending_approval', 'pending');
    await shots(page, 'plan-review');
    await save(page, 'plan-review');
    // The keyboard reaches the reason and the Approve button.
    await page.goto(`/console/plans/${PLAN}`);
    report.focus.approve = await tabTo(page, 'button[approve]');
    must(report.focus.approve.includes('textarea#reason'), 'the reason comes before the buttons');

    await page.getByLabel(/^Reason/).fill('reviewed in the browser test');
    await Promise.all([
      page.waitForURL(`${BASE}/console/plans/${PLAN}?done=approved`),
      page.getByRole('button', { name: 'Approve' }).click(),
    ]);
    must((await page.getByRole('status').innerText()).includes('Approved.'), 'the review says Approved.');
    must((await page.locator('.state-name').innerText()) === 'approved', 'approved');
    must((await page.locator('form[action$="/decide"]').count()) === 0, 'no form once decided');
    await save(page, 'plan-approved');
  });

  // --- the auditor: sees the plan, cannot approve -------------------------
  await stage('auditor', async () => {
    const ctx = await context('auditor');
    const p = await ctx.newPage();
    auditor = p;
    await signIn(p, AUDITOR);
    await open(p, '/console/approvals', 'queue');
    must((await p.getByRole('link', { name: PLAN2, exact: true }).count()) === 1, `the auditor sees ${PLAN2}`);
    await open(p, `/console/plans/${PLAN2}`, 'review');
    must((await p.locator('form[action$="/decide"]').count()) === 0, 'no decide form for an auditor');
    must((await p.getByRole('button', { name: 'Approve' }).count()) === 0, 'no Approve button for an auditor');
    must((await p.locator('pre.command').count()) === 0, 'no command for an auditor');
    must((await p.getByText('shown only to people who may decide').count()) === 1, 'the auditor is told why');
    await save(p, 'plan-auditor');
    // A decision forged with the auditor's own session and CSRF token: the
    // broker refuses it, and the review says so.
    const csrf = await p.locator('input[name="csrf"]').first().getAttribute('value');
    const r = await p.request.post(`/console/plans/${PLAN2}/decide`, {
      form: { csrf, decision: 'approve', reason: '' },
      maxRedirects: 0,
    });
    must(r.status() === 303, `a forged decision answers 303: ${r.status()}`);
    // The broker's code (the Rust side checks /v1 gives the auditor the same).
    const to = r.headers()['location'];
    const code = /^\/console\/plans\/[^?]+\?error=([a-z_]+)$/.exec(to)?.[1];
    must(to.startsWith(`/console/plans/${PLAN2}?error=`) && code, `refused with a code: ${to}`);
    report.auditor_refused = code;
    await open(p, to, 'review');
    must((await p.getByRole('alert').innerText()).includes(`(${code})`), `the review shows ${code}`);
    must((await p.locator('.state-name').innerText()) === 'pending_approval', 'still pending');
  });

  // --- JavaScript off: sign in and approve with plain forms ---------------
  await stage('no-javascript', async () => {
    const ctx = await context('no-javascript', { javaScriptEnabled: false });
    const p = await ctx.newPage();
    await signIn(p, SECOND);
    await open(p, '/console/approvals', 'queue');
    await Promise.all([p.waitForURL(`${BASE}/console/plans/${PLAN2}`), p.getByRole('link', { name: PLAN2, exact: true }).click()]);
    await p.getByLabel(/^Reason/).fill('approved without JavaScript');
    await Promise.all([
      p.waitForURL(`${BASE}/console/plans/${PLAN2}?done=approved`),
      p.getByRole('button', { name: 'Approve' }).click(),
    ]);
    must((await p.locator('.state-name').innerText()) === 'approved', 'approved without JavaScript');
    // Sign out, still without JavaScript.
    await Promise.all([p.waitForURL(`${BASE}/console/sign-in`), p.getByRole('button', { name: 'Sign out' }).click()]);
    await ctx.close();
  });

  // --- the agent submits; the task runs (outside the browser) -------------
  await stage('task runs', async () => {
    const [st, v] = await v1('POST', `/v1/task-plans/${PLAN}/submit`, {});
    must(st === 202, `submit: ${st} ${JSON.stringify(v)}`);
    const tr = v.task_ref;
    report.task_ref = tr;
    for (let i = 0; ; i++) {
      const [s2, status] = await v1('GET', `/v1/tasks/${tr}/status`);
      must(s2 === 200, `status: ${s2}`);
      if (status.execution_ended) {
        must(status.state === 'succeeded', `the task succeeded: ${JSON.stringify(status)}`);
        break;
      }
      must(i < 600, 'the task ends within a minute');
      await new Promise((r) => setTimeout(r, 100));
    }
    // The agent collects its result: the receipt is signed.
    const [s3, res] = await v1('POST', `/v1/tasks/${tr}/result`, {});
    must(s3 === 200 && res.receipt, `result: ${s3}`);
  });

  // --- 2. the task in the console; its receipt -----------------------------
  await stage('task and receipt', async () => {
    const tr = report.task_ref;
    must(tr, 'a task');
    await open(page, '/console/tasks', 'tasks');
    const link = page.getByRole('link', { name: tr, exact: true });
    must((await link.count()) === 1, `the task list shows ${tr}`);
    await save(page, 'tasks');
    await Promise.all([page.waitForURL(`${BASE}/console/tasks/${tr}`), link.click()]);
    const state = await page.locator('dd.task-state').innerText();
    must(state === 'succeeded', `the task page shows succeeded: ${state}`);
    await shots(page, 'task');
    await save(page, 'task');
    // Download the receipt, as a person would keep it.
    const [download] = await Promise.all([
      page.waitForEvent('download'),
      page.getByRole('link', { name: 'Download the receipt' }).first().click(),
    ]);
    const file = join(OUT, 'receipt.json');
    await download.saveAs(file);
    report.receipt_file = file;
    // The appliance verifies it: every signature, and the audit head it names.
    await Promise.all([page.waitForURL(`${BASE}/console/tasks/${tr}/verify`), page.getByRole('link', { name: 'Verify it' }).click()]);
    const verdict = await page.locator('#verdict').innerText();
    must(verdict.startsWith('Valid:'), `the receipt verifies: ${verdict}`);
    const head = await page.locator('#head-in-journal').innerText();
    must(head.startsWith('yes'), `the receipt's audit head is in the journal: ${head}`);
    await shots(page, 'receipt-verify');
    await save(page, 'receipt-verify');
  });

  // --- 3. the audit log (the auditor): search for the task, export CSV ----
  await stage('audit search and export', async () => {
    const tr = report.task_ref;
    must(tr, 'a task');
    await open(auditor, '/console/audit', 'audit');
    const field = auditor.getByLabel('Task ref', { exact: true });
    await field.fill(tr);
    await Promise.all([auditor.waitForURL(/\/console\/audit\?/), field.press('Enter')]);
    must(new URL(auditor.url()).searchParams.get('task_ref') === tr, `searched for ${tr}: ${auditor.url()}`);
    const rows = auditor.locator('table.audit tbody tr');
    const n = await rows.count();
    must(n >= 2, `the search finds the task's events (${n})`);
    for (let i = 0; i < n; i++) {
      must((await rows.nth(i).innerText()).includes(tr), `row ${i} is the task's`);
    }
    const actions = await auditor.locator('table.audit tbody td:nth-child(3)').allInnerTexts();
    must(actions.includes('task_submit'), `task_submit among ${actions}`);
    await shots(auditor, 'audit');
    await save(auditor, 'audit');
    const [download] = await Promise.all([auditor.waitForEvent('download'), auditor.locator('#export-csv').click()]);
    must(download.suggestedFilename().endsWith('.csv'), `a CSV file: ${download.suggestedFilename()}`);
    const file = join(OUT, 'audit.csv');
    await download.saveAs(file);
    report.csv_file = file;
  });

  // --- approvals people can trust (issue #36) ---------------------------
  await stage('trust', async () => {
    // From a notification's link, signed out: sign in, then Approve — two
    // actions; Approve within the first 800 px at 1280 px.
    const ctx = await context('notified');
    const p = await ctx.newPage();
    await p.goto(`/console/plans/${TRUST_DIFF}`);
    must(p.url() === `${BASE}/console/sign-in?next=/console/plans/${TRUST_DIFF}`, `signed out, the link goes to sign-in and back (${p.url()})`);
    await p.getByLabel('User name').fill(APPROVER);
    await p.getByLabel('Password').fill(PASSWORD);
    let actions = 0;
    await Promise.all([p.waitForURL(`${BASE}/console/plans/${TRUST_DIFF}`), p.getByRole('button', { name: 'Sign in' }).click()]);
    actions += 1;
    const approve = p.getByRole('button', { name: 'Approve' });
    await shots(p, 'plan-changed');
    await save(p, 'plan-changed');
    const box = await approve.boundingBox();
    report.trust.approve_bottom = Math.round(box.y + box.height);
    must(box.y + box.height <= 800, `Approve within the first 800 px: its bottom is at ${box.y + box.height}`);
    // What changed, and what is risky.
    must((await p.locator('#risks').innerText()).includes('replicas'), 'the risky value is named');
    must((await p.locator('#risks mark.risky').count()) >= 1, 'the risky value is highlighted');
    const compared = await p.locator('#compared').innerText();
    must(compared.includes('Changed since') && compared.includes(TRUST_BEFORE) && compared.includes('replicas'), `compared with the approved plan: ${compared}`);
    const row = p.locator('#diff tr.changed');
    must((await row.count()) === 1, 'one parameter changed');
    const cells = await row.locator('td').allInnerTexts();
    must(cells[0].startsWith('replicas') && cells[1] === '3' && cells[2] === '30', `replicas 3 → 30: ${cells}`);
    must((await p.locator('#why').innerText()) === 'More capacity for the sale.', 'why, first');
    must((await p.locator('#asked-by').innerText()).startsWith('agent-a (token '), 'who asked, by name');
    await p.getByLabel(/^Reason/).fill('sale week, capacity agreed');
    await Promise.all([p.waitForURL(`${BASE}/console/plans/${TRUST_DIFF}?done=counted`), approve.click()]);
    actions += 1;
    report.trust.actions = actions;
    // Quorum: one approval of two; pending still.
    must((await p.getByRole('status').innerText()).includes('needs more approvals'), 'counted, not approved');
    must((await p.locator('.state-name').innerText()) === 'pending_approval', 'still pending');
    must((await p.locator('#approvals').innerText()).startsWith('1 of 2'), 'one of two');
    // Approving again: the same person does not count twice.
    must((await p.getByRole('button', { name: 'Approve' }).count()) === 1, 'the form is still there');
    await Promise.all([p.waitForURL(`${BASE}/console/plans/${TRUST_DIFF}?error=already_approved`), p.getByRole('button', { name: 'Approve' }).click()]);
    must((await p.getByRole('alert').innerText()).includes('already_approved'), 'already approved');
    await ctx.close();
    // The second, distinct approver makes it runnable.
    const ctx2 = await context('second-approver');
    const q = await ctx2.newPage();
    await signIn(q, SECOND);
    await open(q, `/console/plans/${TRUST_DIFF}`, 'review');
    await Promise.all([q.waitForURL(`${BASE}/console/plans/${TRUST_DIFF}?done=approved`), q.getByRole('button', { name: 'Approve' }).click()]);
    must((await q.locator('.state-name').innerText()) === 'approved', 'approved by two');
    const two = await q.locator('#approvals').innerText();
    must(two.startsWith('2 of 2') && two.includes(APPROVER) && two.includes(SECOND), `both named: ${two}`);
    await save(q, 'plan-quorum');

    // Nothing hidden: the banner, each hidden character as its code, the
    // homoglyph marked.
    await open(q, `/console/plans/${TRUST_HIDDEN}`, 'review');
    const banner = await q.locator('#hidden-banner').innerText();
    for (const w of ['bidirectional control', 'U+202E', 'invisible character', 'U+200B', 'mixing scripts']) {
      must(banner.includes(w), `the banner names ${w}: ${banner}`);
    }
    const marks = await q.locator('#parameters mark.hidden-char').allInnerTexts();
    must(marks.includes('U+202E') && marks.includes('U+200B'), `hidden characters escaped: ${marks}`);
    const cmdMarks = await q.locator('#command mark.hidden-char').allInnerTexts();
    must(cmdMarks.includes('U+202E'), `escaped in the command too: ${cmdMarks}`);
    const glyph = q.locator('#parameters mark.confusable');
    must((await glyph.count()) >= 1 && (await glyph.first().innerText()) === 'm\u0430in', 'the homoglyph is marked');
    must((await glyph.first().getAttribute('title')).includes('U+0430'), 'its letter is named');
    await shots(q, 'plan-hidden');
    await save(q, 'plan-hidden');
    await ctx2.close();
  });

  // --- the queue says when it changed, and never moves focus -------------
  await stage('queue news', async () => {
    await open(page, '/console/approvals', 'queue');
    must((await page.locator('meta[http-equiv="refresh"]').count()) === 0, 'the queue does not reload itself');
    const first = page.locator('table.queue a').first();
    await first.focus();
    const before = await focused(page);
    const [st, v] = await v1('POST', '/v1/tasks/plan', { template: 'word-count', parameters: { text: 'news', repeat: 1 }, reason: 'a new one' });
    must(st === 201, `a new plan: ${st} ${JSON.stringify(v)}`);
    const news = page.locator('#queue-news');
    await news.waitFor({ state: 'visible', timeout: 20000 });
    const text = await news.innerText();
    must(text.startsWith('1 new;'), `the notice says so: ${text}`);
    must((await focused(page)) === before, `focus stays on ${before}`);
    report.trust.queue_news = text;
  });

  // --- the other main pages: screenshots ---------------------------------
  await stage('leases', async () => {
    await open(page, '/console/leases', 'leases');
    must((await page.locator('h1').innerText()).startsWith('Leases'), 'the Leases page');
    await shots(page, 'leases');
    await save(page, 'leases');
  });
  await stage('identities', async () => {
    const ctx = await context('admin');
    const p = await ctx.newPage();
    await signIn(p, ADMIN);
    await open(p, '/console/identities', 'identities');
    must((await p.locator('h1').innerText()) === 'Identities', 'the Identities page');
    await shots(p, 'identities');
    await save(p, 'identities');
    // Revoke asks first; Cancel goes back with nothing revoked (issue #36).
    const revoke = p.getByRole('button', { name: /^Revoke token / }).first();
    await Promise.all([p.waitForURL(/\/revoke$/), revoke.click()]);
    must((await p.locator('h1').innerText()) === 'Revoke this identity?', 'Revoke asks first');
    await shots(p, 'confirm');
    await save(p, 'confirm');
    await Promise.all([p.waitForURL(`${BASE}/console/identities`), p.locator('#confirm-cancel').click()]);
    must((await p.getByRole('button', { name: /^Revoke token / }).count()) >= 1, 'nothing revoked');
    await open(p, '/console/connect', 'connect');
    must((await p.locator('h1').innerText()).startsWith('Connect'), 'the Connect an agent page');
    await shots(p, 'connect');
    await save(p, 'connect');
    await ctx.close();
  });

  // --- a dark-scheme variant ---------------------------------------------
  await stage('dark', async () => {
    const ctx = await context('dark', { colorScheme: 'dark', storageState: await alice.storageState() });
    const p = await ctx.newPage();
    await open(p, '/console', 'overview');
    const bg = await p.evaluate(() => getComputedStyle(document.body).backgroundColor);
    await p.emulateMedia({ colorScheme: 'light' });
    const light = await p.evaluate(() => getComputedStyle(document.body).backgroundColor);
    must(bg !== light, `the dark scheme changes the background (${bg} vs ${light})`);
    await p.emulateMedia({ colorScheme: 'dark' });
    await shot(p, 'overview-dark');
    await ctx.close();
  });

  must(report.problems.length === 0, `no console errors: ${JSON.stringify(report.problems)}`);
  report.ok = true;
} catch (e) {
  report.error = String(e.stack || e);
  process.stderr.write(`browser: FAILED: ${report.error}\n`);
  if (page) {
    try {
      await page.screenshot({ path: join(OUT, 'failure.png'), fullPage: true });
      writeFileSync(join(OUT, 'failure.html'), await page.content());
    } catch {}
  }
} finally {
  report.failed_loads = seen404;
  writeFileSync(join(OUT, 'report.json'), JSON.stringify(report, null, 2));
  await browser.close();
}
process.exit(report.ok ? 0 : 1);
