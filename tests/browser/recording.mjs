// The session recording player in real headless Chromium (issue 40), driven
// by playwright-core. Run by tests/it/ptys.rs, which records a PTY session
// (with an appliance SIGKILL in the middle) and makes an auditor; not meant
// to be run alone.
//
// Environment (set by the Rust test):
//   CUBE_URL, CUBE_SPKI    the appliance, and its certificate's key
//   CUBE_USER, CUBE_PASSWORD  an auditor of the recording's tenant
//   CUBE_RECORDING         the recording's ref
//   CUBE_BEFORE, CUBE_AFTER   text written before and after the SIGKILL
//   CUBE_OUT               where the report, the page and the download go
//
// Writes CUBE_OUT/report.json: {ok, error, problems, download, screen_end,
// screen_hit, hits, plain}. Exit 0 only if every step held.

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const env = (k) => {
  const v = process.env[k];
  if (v === undefined) throw new Error(`${k} is not set`);
  return v;
};
const BASE = env('CUBE_URL');
const OUT = env('CUBE_OUT');
const REC = env('CUBE_RECORDING');
const BEFORE = env('CUBE_BEFORE');
const AFTER = env('CUBE_AFTER');
mkdirSync(OUT, { recursive: true });
const report = { ok: false, error: '', problems: [] };
const must = (c, what) => { if (!c) throw new Error(what); };

const browser = await chromium.launch({
  executablePath: process.env.CUBE_CHROMIUM || '/usr/bin/chromium',
  headless: true,
  chromiumSandbox: false,
  args: ['--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--disable-dev-shm-usage',
    `--ignore-certificate-errors-spki-list=${env('CUBE_SPKI')}`],
});
try {
  const ctx = await browser.newContext({ baseURL: BASE, acceptDownloads: true, viewport: { width: 1280, height: 900 } });
  const page = await ctx.newPage();
  page.on('console', (m) => {
    // Chromium asks for /favicon.ico by itself; the appliance has none.
    const at = m.location().url || '';
    if (m.text().startsWith('Failed to load resource') && at.startsWith(BASE) && new URL(at).pathname === '/favicon.ico') return;
    if (m.type() === 'error' || m.type() === 'warning') report.problems.push(`console ${m.type()}: ${m.text()} (${at})`);
  });
  page.on('pageerror', (e) => report.problems.push(`page error: ${e}`));
  await page.goto('/console/sign-in');
  await page.getByLabel('User name').fill(env('CUBE_USER'));
  await page.getByLabel('Password').fill(env('CUBE_PASSWORD'));
  await Promise.all([page.waitForURL(`${BASE}/console`), page.getByRole('button', { name: 'Sign in' }).click()]);

  // From the list to the player.
  await page.goto('/console/recordings');
  await page.getByRole('link', { name: REC }).click();
  await page.waitForURL(`${BASE}/console/recordings/${REC}`);
  // The player loads the file and shows itself.
  await page.locator('#player').waitFor({ state: 'visible' });
  report.plain = await page.locator('#plain-output').innerText();
  must(report.plain.includes(BEFORE) && report.plain.includes(AFTER), 'the text view has both sides of the restart');

  // To the end: the screen shows what came after the restart.
  await page.getByRole('button', { name: 'To the end' }).click();
  report.screen_end = await page.locator('#play-screen').innerText();
  must(report.screen_end.includes(AFTER), 'at the end the screen shows the output after the restart');

  // Search, then seek to the hit: the screen is as it was then.
  await page.getByLabel('Search the output').fill(BEFORE);
  await page.getByRole('button', { name: 'Search' }).click();
  const hits = page.locator('#play-hits button.hit');
  await hits.first().waitFor();
  report.hits = await hits.count();
  await hits.first().click();
  report.screen_hit = await page.locator('#play-screen').innerText();
  must(report.screen_hit.includes(BEFORE), 'the hit shows its output');
  must(!report.screen_hit.includes(AFTER), 'seeking back undoes what came later');

  // Play at 16×: it runs to the end by itself.
  await page.getByLabel('Speed').selectOption('16');
  await page.getByRole('button', { name: 'Play' }).click();
  await page.getByRole('button', { name: 'Play' }).waitFor({ timeout: 20000 });
  must((await page.locator('#play-screen').innerText()).includes(AFTER), 'playing reaches the end');

  // Download: the file itself.
  const [dl] = await Promise.all([page.waitForEvent('download'), page.locator('#rec-download').click()]);
  report.download = join(OUT, `${REC}.cast`);
  await dl.saveAs(report.download);
  writeFileSync(join(OUT, 'player.html'), await page.content());
  await page.screenshot({ path: join(OUT, 'player.png') });
  must(report.problems.length === 0, `problems: ${report.problems.join('; ')}`);
  report.ok = true;
} catch (e) {
  report.error = String(e && e.stack || e);
} finally {
  writeFileSync(join(OUT, 'report.json'), JSON.stringify(report, null, 2));
  await browser.close();
}
process.exit(report.ok ? 0 : 1);
