// Signing in to the web console with OpenID Connect, in real headless
// Chromium driven by playwright-core: the appliance's "Sign in with ..."
// link, the provider's own login page (tests/oidc/provider.mjs, devInteractions)
// and back. Run by a Rust test, which starts the provider and the appliance
// (configured with it) and reads the JSON report this script writes; it is
// not meant to be run alone.
//
// Environment (all set by the Rust test):
//   CUBE_URL       https://127.0.0.1:PORT (the appliance)
//   CUBE_SPKI      base64 SHA-256 of the server certificate's
//                  SubjectPublicKeyInfo: the one key Chromium accepts
//   CUBE_CHROMIUM  the browser (default /usr/bin/chromium)
//   CUBE_OUT       a directory for the report (report.json) and failure pages
//   CUBE_SCREENS   where screenshots go
//   OIDC_ISSUER    http://127.0.0.1:OTHERPORT (the provider)
//   OIDC_APPROVER  an account whose groups make it an approver (e.g. alice)
//   OIDC_AUDITOR   an account whose groups make it an auditor (e.g. bob)
//   OIDC_NOBODY    an account whose groups map to no console role (e.g. carol)
//
// Steps, each in its own browser context (the provider keeps its session
// per browser, so a second person in the same context would get no form):
//   approver       /console -> sign-in -> a#oidc-sign-in -> the provider's
//                  login -> the callback (200, meta refresh) -> the Overview,
//                  span.who names the approver and the role "approver"
//   sign-out       the header's Sign out lands on the sign-in page; /console
//                  again goes to sign-in (the session ended)
//   auditor        the same flow; role "auditor"; the nav links /console/audit
//   nobody         the same flow ends on the callback's 403 "Not for your
//                  role" page; /console still goes to sign-in
//   forged callback  /console/oidc/callback?code=x&state=y with no sign-in
//                  started: 400 or 403 (report.forged_status), no session
//
// Throughout: no console error or warning, no page error, no CSP violation,
// no failed request, no error answer other than the two the steps ask for,
// and no request to anything but 127.0.0.1 on the appliance's or the
// provider's port. Exit status 0 only if every step passed.

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const env = (k, d) => {
  const v = process.env[k] || d;
  if (v === undefined) throw new Error(`${k} is not set`);
  return v;
};
const BASE = env('CUBE_URL').replace(/\/+$/, '');
const ISSUER = env('OIDC_ISSUER').replace(/\/+$/, '');
const APPROVER = env('OIDC_APPROVER');
const AUDITOR = env('OIDC_AUDITOR');
const NOBODY = env('OIDC_NOBODY');
const OUT = env('CUBE_OUT');
const SCREENS = env('CUBE_SCREENS');
// The provider's devInteractions take any password that is not empty.
const PASSWORD = 'any-password';
const CALLBACK = '/console/oidc/callback';

mkdirSync(OUT, { recursive: true });
mkdirSync(SCREENS, { recursive: true });

const report = {
  ok: false,
  browser: '',
  steps: [], // "name: done" or "name: FAILED: why", in order
  failed: [], // the names of the steps that failed
  problems: [], // console errors, page errors, CSP violations, failed requests, error answers
  outside: [], // requests to anything but the two origins
  screenshots: [],
  link_text: null, // the text of a#oidc-sign-in
  who: {}, // span.who per person
  nobody_status: null, // the callback's answer for a person without a role (403)
  forged_status: null, // the forged callback's answer (400 or 403)
  cookies: {}, // per person once signed in: names and flags of the console's cookies (no values)
  error: null,
};
const step = (s) => {
  report.steps.push(s);
  process.stderr.write(`oidc browser: ${s}\n`);
};
const must = (cond, what) => {
  if (!cond) throw new Error(`check failed: ${what}`);
};

const DESKTOP = { width: 1280, height: 800 };
// The only two places the browser may talk to.
const ALLOWED = new Set([new URL(BASE).origin, new URL(ISSUER).origin]);
for (const o of ALLOWED) {
  must(new URL(o).hostname === '127.0.0.1', `${o} is on 127.0.0.1`);
}
const inBase = (url) => url.startsWith(`${BASE}/`) || url === BASE;
const pathOf = (url) => {
  try {
    return new URL(url).pathname;
  } catch {
    return '';
  }
};

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

/**
 * A new context (a new person: no cookies, no provider session) whose pages
 * report console errors, page errors, CSP violations, failed requests,
 * error answers and requests elsewhere. `expected` lists the error answers
 * its step asks for, as "GET /path STATUS".
 */
async function context(name, expected = []) {
  const ctx = await browser.newContext({ baseURL: BASE, viewport: DESKTOP, deviceScaleFactor: 1 });
  ctx.setDefaultTimeout(15000);
  const allowed = new Set(expected);
  // CSP violations as the page sees them (Chromium also logs them as
  // console errors; this names the directive).
  await ctx.exposeBinding('__cubeCspViolation', ({ page }, v) => {
    report.problems.push({ context: name, url: page?.url() ?? '', kind: 'CSP violation', text: v });
  });
  await ctx.addInitScript(() => {
    document.addEventListener('securitypolicyviolation', (e) => {
      // eslint-disable-next-line no-underscore-dangle
      window.__cubeCspViolation(`${e.violatedDirective} blocked ${e.blockedURI || '(inline)'} at ${e.sourceFile || ''}:${e.lineNumber || 0}`);
    });
  });
  ctx.on('request', (r) => {
    const u = r.url();
    let origin;
    try {
      origin = new URL(u).origin;
    } catch {
      origin = 'null';
    }
    if (/^(data|blob|about):/.test(u)) return;
    if (!ALLOWED.has(origin)) report.outside.push({ context: name, url: u });
  });
  ctx.on('page', (p) => watch(p, name, allowed));
  return ctx;
}

/** Is this a favicon load (Chromium asks for one by itself; neither server has one)? */
const favicon = (url) => pathOf(url) === '/favicon.ico';

function watch(page, name, allowed) {
  page.on('console', (m) => {
    const at = m.location().url || '';
    if (m.text().startsWith('Failed to load resource')) {
      // The error answers a step asks for (its page load) are expected;
      // so is Chromium's own /favicon.ico. Anything else is a problem.
      if (favicon(at)) return;
      const status = /status of (\d{3})/.exec(m.text())?.[1];
      if (inBase(at) && status && allowed.has(`GET ${pathOf(at)} ${status}`)) return;
    } else if (m.type() !== 'error' && m.type() !== 'warning') {
      return;
    }
    report.problems.push({ context: name, url: page.url(), kind: `console ${m.type()}`, text: `${m.text()} (${at})` });
  });
  page.on('pageerror', (e) => report.problems.push({ context: name, url: page.url(), kind: 'page error', text: String(e) }));
  page.on('requestfailed', (r) => {
    const f = r.failure()?.errorText ?? '';
    // A navigation replaced by the next one (the meta refresh, a click
    // during a load) ends as "aborted": not a failure.
    if (f.includes('ERR_ABORTED') && r.isNavigationRequest()) return;
    report.problems.push({ context: name, url: r.url(), kind: 'request failed', text: f });
  });
  page.on('response', (r) => {
    if (r.status() < 400 || favicon(r.url())) return;
    const key = `${r.request().method()} ${pathOf(r.url())} ${r.status()}`;
    if (inBase(r.url()) && allowed.has(key)) return;
    report.problems.push({ context: name, url: r.url(), kind: 'error answer', text: key });
  });
}

// Long pages are cut at this height: the top says what the page is.
const MAX_HEIGHT = 1200;

async function shot(page, name) {
  const file = join(SCREENS, `${name}.png`);
  const { width } = page.viewportSize();
  const height = Math.min(MAX_HEIGHT, await page.evaluate(() => document.documentElement.scrollHeight));
  const png = await page.screenshot({ path: file, fullPage: true, clip: { x: 0, y: 0, width, height }, animations: 'disabled' });
  report.screenshots.push({ name, file, bytes: png.length });
}

/** Signed out, /console sends to the sign-in page. */
async function signedOut(page, what) {
  const r = await page.goto('/console');
  must(r && r.ok(), `${what}: /console answers ${r && r.status()} at ${page.url()}`);
  must(page.url() === `${BASE}/console/sign-in`, `${what}: /console goes to the sign-in page (${page.url()})`);
}

/**
 * From the console's sign-in page through the provider's login and back to
 * the callback. Resolves with the callback's response once the provider
 * has sent the browser there (the page then moves on by itself, or not).
 */
async function throughProvider(page, account, who) {
  await signedOut(page, who);
  const link = page.locator('a#oidc-sign-in');
  must((await link.count()) === 1, `${who}: the sign-in page has a#oidc-sign-in`);
  const text = (await link.innerText()).trim();
  must(text.startsWith('Sign in with '), `${who}: the link reads "Sign in with <label>": ${JSON.stringify(text)}`);
  report.link_text = text;

  // The link: /console/oidc/start -> 303 -> the provider's /auth -> its login page.
  await Promise.all([page.waitForURL((u) => u.origin === new URL(ISSUER).origin), link.click()]);
  const login = page.locator('input[name="login"]');
  await login.waitFor({ state: 'visible' });
  if (who === 'approver') await shot(page, 'oidc-provider-login');
  await login.fill(account);
  await page.locator('input[name="password"]').fill(PASSWORD);
  const [callback] = await Promise.all([
    page.waitForResponse((r) => inBase(r.url()) && pathOf(r.url()) === CALLBACK && r.request().isNavigationRequest()),
    page.locator('button[type="submit"]').click(),
  ]);
  const q = new URL(callback.url()).searchParams;
  must(q.get('code') && q.get('state'), `${who}: the provider sends back a code and the state (${callback.url()})`);
  return callback;
}

/** A person with a role: through the provider to the Overview, named in the header. */
async function signInWith(page, account, who, role) {
  const callback = await throughProvider(page, account, who);
  must(callback.status() === 200, `${who}: the callback answers 200 (a page that moves on), not ${callback.status()}`);
  // (Already there if the page moved on at once: waitForURL checks the current URL first.)
  await page.waitForURL(`${BASE}/console`);
  must((await page.locator('h1').first().innerText()).trim() === 'Overview', `${who} lands on the Overview`);
  const name = page.locator('header span.who');
  must((await name.count()) === 1, `${who}: the header has span.who`);
  const text = (await name.innerText()).trim();
  report.who[who] = text;
  // "<name> (<roles>)"
  const roles = /\(([^)]*)\)\s*$/.exec(text)?.[1] ?? '';
  must(text.includes(account), `${who}: span.who names ${account}: ${JSON.stringify(text)}`);
  must(roles.split(/[\s,]+/).includes(role), `${who}: span.who shows the role ${role}: ${JSON.stringify(text)}`);
  // What the console set (names and flags; never the values).
  const cookies = await page.context().cookies(BASE);
  report.cookies[who] = cookies
    .filter((c) => !c.name.startsWith('op_') && !c.name.startsWith('_interaction') && !c.name.startsWith('_session'))
    .map(({ name, path, secure, httpOnly, sameSite, expires }) => ({ name, path, secure, httpOnly, sameSite, session: expires === -1 }));
}

/** Run a step; a failure is recorded (screenshot and page) and the next step runs. */
async function stage(name, fn) {
  let page;
  try {
    await fn((p) => {
      page = p;
    });
    step(`${name}: done`);
  } catch (e) {
    report.failed.push(name);
    step(`${name}: FAILED: ${e.message}`);
    report.error = `${report.error ? `${report.error}\n` : ''}${name}: ${String(e.stack || e)}`;
    if (page) {
      const base = `failure-${name.replace(/[^a-z0-9]+/gi, '-')}`;
      try {
        await page.screenshot({ path: join(OUT, `${base}.png`), fullPage: true });
        writeFileSync(join(OUT, `${base}.html`), `<!-- ${page.url()} -->\n${await page.content()}`);
      } catch {}
    }
  }
}

let approverPage; // signed in by step 1, signed out by step 2

try {
  // --- 1. an approver signs in with the provider --------------------------
  await stage('approver', async (track) => {
    const ctx = await context('approver');
    const page = await ctx.newPage();
    track(page);
    await signedOut(page, 'approver');
    await shot(page, 'oidc-sign-in');
    await signInWith(page, APPROVER, 'approver', 'approver');
    await shot(page, 'oidc-overview-approver');
    approverPage = page;
  });

  // --- 2. the approver signs out ------------------------------------------
  await stage('sign-out', async (track) => {
    must(approverPage, 'the approver is signed in (step approver)');
    const page = approverPage;
    track(page);
    const button = page.locator('form.signout button[type="submit"]');
    must((await button.count()) === 1, 'the header has the sign-out button');
    must((await button.innerText()).trim() === 'Sign out', 'the button reads Sign out');
    await Promise.all([page.waitForURL(`${BASE}/console/sign-in`), button.click()]);
    // The session ended: the console sends to the sign-in page again.
    await signedOut(page, 'signed out');
    must((await page.locator('span.who').count()) === 0, 'no one named in the header once signed out');
    await page.context().close();
  });

  // --- 3. an auditor ------------------------------------------------------
  await stage('auditor', async (track) => {
    const ctx = await context('auditor');
    const page = await ctx.newPage();
    track(page);
    await signInWith(page, AUDITOR, 'auditor', 'auditor');
    must((await page.locator('header nav a[href="/console/audit"]').count()) === 1, 'the auditor\'s nav links to /console/audit');
    await shot(page, 'oidc-overview-auditor');
    await ctx.close();
  });

  // --- 4. a person whose groups give no console role ----------------------
  await stage('nobody', async (track) => {
    const ctx = await context('nobody', [`GET ${CALLBACK} 403`]);
    const page = await ctx.newPage();
    track(page);
    const callback = await throughProvider(page, NOBODY, 'nobody');
    report.nobody_status = callback.status();
    must(callback.status() === 403, `the callback answers 403 for a person without a role, not ${callback.status()}`);
    await page.waitForLoadState('load');
    must(pathOf(page.url()) === CALLBACK, `the 403 page stays (${page.url()})`);
    must((await page.locator('h1').first().innerText()).trim() === 'Not for your role', 'the page says "Not for your role"');
    must((await page.locator('body').innerText()).includes('The console is for approvers, auditors and admins.'), 'the page says who the console is for');
    must((await page.locator('span.who').count()) === 0, 'no one named in the header');
    await shot(page, 'oidc-not-for-your-role');
    await signedOut(page, 'nobody, after the 403');
    await ctx.close();
  });

  // --- 5. a callback no sign-in started -----------------------------------
  await stage('forged callback', async (track) => {
    const ctx = await context('forged callback', [`GET ${CALLBACK} 400`, `GET ${CALLBACK} 403`]);
    const page = await ctx.newPage();
    track(page);
    const r = await page.goto(`${CALLBACK}?code=x&state=y`);
    must(r, 'the forged callback answers');
    report.forged_status = r.status();
    must([400, 403].includes(r.status()), `the forged callback answers 400 or 403, not ${r.status()}`);
    must((r.headers()['content-type'] || '').startsWith('text/html'), `an HTML error page (${r.headers()['content-type']})`);
    must((await page.locator('h1').count()) >= 1, 'the error page has a heading');
    must((await page.locator('span.who').count()) === 0, 'no one named in the header');
    await shot(page, 'oidc-forged-callback');
    await signedOut(page, 'after the forged callback');
    await ctx.close();
  });
} catch (e) {
  report.error = `${report.error ? `${report.error}\n` : ''}${String(e.stack || e)}`;
  process.stderr.write(`oidc browser: FAILED: ${e.stack || e}\n`);
} finally {
  try {
    await browser.close();
  } catch {}
  const clean = report.problems.length === 0 && report.outside.length === 0;
  if (!clean) {
    const msg = `problems: ${JSON.stringify(report.problems)}; requests elsewhere: ${JSON.stringify(report.outside)}`;
    process.stderr.write(`oidc browser: ${msg}\n`);
    report.error = `${report.error ? `${report.error}\n` : ''}${msg}`;
  }
  report.ok = report.failed.length === 0 && report.steps.length === 5 && clean && !report.error;
  writeFileSync(join(OUT, 'report.json'), JSON.stringify(report, null, 2));
}
process.exit(report.ok ? 0 : 1);
