// Smoke check of provider.mjs, no browser: `node tests/oidc/smoke.mjs`.
// Starts the provider (RS256, then once more with ES256), and checks
// discovery, the JWKS, a client_credentials JWT, the authorization code +
// PKCE flow for "alice" through the devInteractions login form (plain fetch
// and a cookie jar), the ID token's claims, userinfo, a few refusals, key
// rotation on SIGUSR1, and a clean exit on SIGTERM. Signatures are verified
// with node:crypto against the served JWKS. Exit status 0 only if all passed.
// Talks to 127.0.0.1 only.

import { spawn } from 'node:child_process';
import {
  createHash, createPublicKey, randomBytes, verify,
} from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';
import { isDeepStrictEqual } from 'node:util';

const HERE = dirname(fileURLToPath(import.meta.url));
const AUDIENCE = 'https://cube-adapter.test';
const AGENT = ['cube-agent', 'agent-secret-0123456789abcdef'];
const CONSOLE = ['cube-console', 'console-secret-0123456789abcdef'];
const REDIRECT = 'https://127.0.0.1:4443/console/oidc/callback';
const AGENT_CLAIMS = {
  tenant_id: 'acme', roles: ['runtime'], cube_profiles: ['offline-code'], cube_actions: ['lease:*', 'exec:run'],
};

let failed = 0;
let passed = 0;
function check(what, ok, detail = '') {
  if (ok) passed += 1; else failed += 1;
  console.log(`${ok ? 'ok  ' : 'FAIL'} ${what}${!ok && detail ? `  -- ${detail}` : ''}`);
  return ok;
}

const b64url = (b) => Buffer.from(b).toString('base64url');
const basic = ([id, secret]) => `Basic ${Buffer.from(`${encodeURIComponent(id)}:${encodeURIComponent(secret)}`).toString('base64')}`;
function decode(jwt) {
  const [h, p, s] = jwt.split('.');
  return {
    header: JSON.parse(Buffer.from(h, 'base64url')),
    payload: JSON.parse(Buffer.from(p, 'base64url')),
    input: `${h}.${p}`,
    sig: Buffer.from(s, 'base64url'),
  };
}
function verifyJwt(jwt, jwks) {
  const { header, input, sig } = decode(jwt);
  const jwk = jwks.keys.find((k) => k.kid === header.kid);
  if (!jwk) return `kid ${header.kid} not in JWKS`;
  const key = createPublicKey({ key: jwk, format: 'jwk' });
  const ok = header.alg === 'ES256'
    ? verify('sha256', Buffer.from(input), { key, dsaEncoding: 'ieee-p1363' }, sig)
    : header.alg === 'RS256' && verify('sha256', Buffer.from(input), key, sig);
  return ok ? true : `bad signature (${header.alg})`;
}

async function start(env) {
  const child = spawn(process.execPath, [join(HERE, 'provider.mjs')], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stderr = '';
  child.stderr.on('data', (d) => { stderr += d; });
  const exited = new Promise((resolve) => child.on('exit', (code, sig) => resolve({ code, sig })));
  const lines = createInterface({ input: child.stdout });
  const first = await Promise.race([
    new Promise((resolve) => lines.once('line', resolve)),
    exited.then((e) => { throw new Error(`provider exited ${JSON.stringify(e)} before its line:\n${stderr}`); }),
    new Promise((_, reject) => setTimeout(() => reject(new Error(`no line after 15 s:\n${stderr}`)), 15000)),
  ]);
  let extra = '';
  lines.on('line', (l) => { extra += `${l}\n`; });
  return {
    child, exited, info: JSON.parse(first), stderr: () => stderr, extraStdout: () => extra,
  };
}

async function stop(p, label) {
  p.child.kill('SIGTERM');
  const e = await Promise.race([p.exited, new Promise((r) => setTimeout(() => r({ timeout: true }), 5000))]);
  check(`${label}: exits 0 on SIGTERM`, e.code === 0, JSON.stringify(e));
  check(`${label}: printed nothing more on stdout`, p.extraStdout() === '', p.extraStdout());
}

async function getJson(url, init) {
  const r = await fetch(url, init);
  const text = await r.text();
  let body;
  try { body = JSON.parse(text); } catch { body = text; }
  return { status: r.status, body, headers: r.headers };
}

async function clientCredentials(issuer, extra = {}, auth = AGENT) {
  return getJson(`${issuer}/token`, {
    method: 'POST',
    headers: { authorization: basic(auth), 'content-type': 'application/x-www-form-urlencoded' },
    body: new URLSearchParams({ grant_type: 'client_credentials', ...extra }),
  });
}

// A tiny cookie jar (names are unique enough for one origin).
class Jar {
  constructor() { this.c = new Map(); }

  take(res) {
    for (const sc of res.headers.getSetCookie()) {
      const [pair, ...attrs] = sc.split(';');
      const i = pair.indexOf('=');
      const name = pair.slice(0, i).trim();
      const value = pair.slice(i + 1).trim();
      const expired = attrs.some((a) => /^\s*expires=Thu, 01 Jan 1970/i.test(a)) || value === '';
      if (expired) this.c.delete(name); else this.c.set(name, value);
      this.attrs ??= [];
      this.attrs.push(sc);
    }
  }

  header() { return [...this.c].map(([k, v]) => `${k}=${v}`).join('; '); }
}

async function codeFlow(issuer, jwks, { account, alg: label, signAlg }) {
  const alg = label;
  const jar = new Jar();
  const verifier = b64url(randomBytes(32));
  const challenge = b64url(createHash('sha256').update(verifier).digest());
  const state = b64url(randomBytes(12));
  const nonce = b64url(randomBytes(12));
  const auth = new URL(`${issuer}/auth`);
  auth.search = new URLSearchParams({
    client_id: CONSOLE[0],
    response_type: 'code',
    scope: 'openid profile email',
    redirect_uri: REDIRECT,
    state,
    nonce,
    code_challenge: challenge,
    code_challenge_method: 'S256',
  });

  let url = auth.href;
  let method = 'GET';
  let body;
  let code;
  let sawLogin = false;
  let sawConsent = false;
  let fontFree = true;
  for (let hop = 0; hop < 15 && !code; hop += 1) {
    const res = await fetch(url, {
      method,
      redirect: 'manual',
      headers: {
        cookie: jar.header(),
        ...(body ? { 'content-type': 'application/x-www-form-urlencoded' } : {}),
      },
      body,
    });
    jar.take(res);
    method = 'GET';
    body = undefined;
    if (res.status >= 300 && res.status < 400) {
      const loc = new URL(res.headers.get('location'), url).href;
      await res.arrayBuffer();
      if (loc.startsWith(REDIRECT)) {
        const q = new URL(loc).searchParams;
        if (q.get('error')) throw new Error(`error at redirect_uri: ${q.get('error')} ${q.get('error_description')}`);
        check(`${alg}: state comes back`, q.get('state') === state);
        check(`${alg}: iss comes back with the code (RFC 9207)`, q.get('iss') === issuer, q.get('iss'));
        code = q.get('code');
        break;
      }
      url = loc;
      continue;
    }
    const html = await res.text();
    if (res.status !== 200) throw new Error(`HTTP ${res.status} at ${url}: ${html.slice(0, 400)}`);
    if (html.includes('googleapis')) fontFree = false;
    const action = html.match(/<form[^>]*action="([^"]+)"[^>]*method="post"/)?.[1];
    if (!action) throw new Error(`no form at ${url}: ${html.slice(0, 400)}`);
    if (html.includes('name="login"')) {
      sawLogin = true;
      check(`${alg}: login page has input[name=login], input[name=password], button[type=submit]`,
        /<input[^>]*name="login"/.test(html) && /<input[^>]*name="password"/.test(html)
        && /<button[^>]*type="submit"[^>]*>Sign-in<\/button>/.test(html));
      body = new URLSearchParams({ prompt: 'login', login: account, password: 'anything' });
    } else if (html.includes('value="consent"')) {
      sawConsent = true;
      body = new URLSearchParams({ prompt: 'consent' });
    } else {
      throw new Error(`unknown page at ${url}: ${html.slice(0, 400)}`);
    }
    url = new URL(action, url).href;
    method = 'POST';
  }
  check(`${alg}: went through the login form`, sawLogin);
  check(`${alg}: no consent page for the first-party console client`, !sawConsent);
  check(`${alg}: interaction pages load nothing from outside (no googleapis)`, fontFree);
  check(`${alg}: cookies are not Secure and are SameSite=Lax`,
    (jar.attrs || []).every((a) => !/;\s*secure/i.test(a) && (/samesite=lax/i.test(a))), (jar.attrs || []).join(' | '));
  if (!check(`${alg}: got a code at the redirect_uri`, !!code)) return;

  const tok = await getJson(`${issuer}/token`, {
    method: 'POST',
    headers: { authorization: basic(CONSOLE), 'content-type': 'application/x-www-form-urlencoded' },
    body: new URLSearchParams({
      grant_type: 'authorization_code', code, redirect_uri: REDIRECT, code_verifier: verifier,
    }),
  });
  if (!check(`${alg}: code + code_verifier exchanged at /token`, tok.status === 200 && tok.body.id_token, JSON.stringify(tok.body))) return;
  const id = decode(tok.body.id_token);
  const p = id.payload;
  const now = Math.floor(Date.now() / 1000);
  check(`${alg}: ID token header alg ${signAlg}`, id.header.alg === signAlg, id.header.alg);
  check(`${alg}: ID token signature verifies with the JWKS`, verifyJwt(tok.body.id_token, jwks) === true, verifyJwt(tok.body.id_token, jwks));
  check(`${alg}: ID token iss/aud/sub/nonce`, p.iss === issuer && p.aud === CONSOLE[0] && p.sub === account && p.nonce === nonce, JSON.stringify(p));
  check(`${alg}: ID token exp/iat`, p.exp > now && p.iat <= now + 5, JSON.stringify(p));
  check(`${alg}: ID token has email, tenant_id, groups`,
    p.email === `${account}@example.test` && p.tenant_id === 'acme' && Array.isArray(p.groups) && p.groups.length === 1,
    JSON.stringify(p));
  if (account === 'alice') check(`${alg}: alice is in cube-approvers`, isDeepStrictEqual(p.groups, ['cube-approvers']), JSON.stringify(p.groups));

  const ui = await getJson(`${issuer}/me`, { headers: { authorization: `Bearer ${tok.body.access_token}` } });
  check(`${alg}: userinfo (/me) answers with the same claims`, ui.status === 200 && ui.body.sub === account && ui.body.tenant_id === 'acme', JSON.stringify(ui.body));

  const again = await getJson(`${issuer}/token`, {
    method: 'POST',
    headers: { authorization: basic(CONSOLE), 'content-type': 'application/x-www-form-urlencoded' },
    body: new URLSearchParams({
      grant_type: 'authorization_code', code, redirect_uri: REDIRECT, code_verifier: verifier,
    }),
  });
  check(`${alg}: a used code is refused`, again.status === 400 && again.body.error === 'invalid_grant', JSON.stringify(again.body));
}

async function run(alg, rotateFile) {
  const p = await start({
    OIDC_ALG: alg,
    OIDC_REDIRECT_URIS: `${REDIRECT},http://127.0.0.1:9/cb`,
    ...(rotateFile ? { OIDC_ROTATE_FILE: rotateFile } : {}),
  });
  try {
    const { issuer, port, kids } = p.info;
    console.log(`-- ${alg}: ${JSON.stringify(p.info)}`);
    check(`${alg}: line has issuer http://127.0.0.1:PORT with the bound port`, issuer === `http://127.0.0.1:${port}` && port > 0);
    check(`${alg}: line has distinct kids for RS256 and ES256`, kids.RS256 && kids.ES256 && kids.RS256 !== kids.ES256);

    const disc = await getJson(`${issuer}/.well-known/openid-configuration`);
    const d = disc.body;
    check(`${alg}: discovery served`, disc.status === 200 && d.issuer === issuer, JSON.stringify(d).slice(0, 200));
    check(`${alg}: discovery endpoints /auth /token /jwks /me`,
      d.authorization_endpoint === `${issuer}/auth` && d.token_endpoint === `${issuer}/token`
      && d.jwks_uri === `${issuer}/jwks` && d.userinfo_endpoint === `${issuer}/me`, JSON.stringify(d));
    check(`${alg}: discovery: S256 PKCE, client_credentials, ID token algs`,
      isDeepStrictEqual(d.code_challenge_methods_supported, ['S256'])
      && d.grant_types_supported.includes('client_credentials')
      && d.id_token_signing_alg_values_supported.includes('RS256') && d.id_token_signing_alg_values_supported.includes('ES256'),
      JSON.stringify(d));
    check(`${alg}: discovery lists tenant_id, groups, email in claims_supported`,
      ['tenant_id', 'groups', 'email'].every((c) => d.claims_supported.includes(c)));

    const jw = await getJson(d.jwks_uri);
    const jwks = jw.body;
    const byKid = Object.fromEntries(jwks.keys.map((k) => [k.kid, k]));
    check(`${alg}: JWKS has the RSA key`, byKid[kids.RS256]?.kty === 'RSA' && byKid[kids.RS256]?.alg === 'RS256' && !byKid[kids.RS256].d, JSON.stringify(jwks));
    check(`${alg}: JWKS has the EC P-256 key`, byKid[kids.ES256]?.kty === 'EC' && byKid[kids.ES256]?.crv === 'P-256' && !byKid[kids.ES256].d, JSON.stringify(jwks));
    check(`${alg}: JWKS has exactly 2 keys`, jwks.keys.length === 2, jwks.keys.length);

    const cc = await clientCredentials(issuer, { resource: AUDIENCE });
    if (check(`${alg}: client_credentials with resource gives a token`, cc.status === 200 && typeof cc.body.access_token === 'string', JSON.stringify(cc.body))) {
      const t = decode(cc.body.access_token);
      const now = Math.floor(Date.now() / 1000);
      check(`${alg}: access token is a JWT, alg ${alg}, kid ${kids[alg]}`, t.header.alg === alg && t.header.kid === kids[alg], JSON.stringify(t.header));
      check(`${alg}: access token signature verifies with the JWKS`, verifyJwt(cc.body.access_token, jwks) === true, verifyJwt(cc.body.access_token, jwks));
      check(`${alg}: iss`, t.payload.iss === issuer, t.payload.iss);
      check(`${alg}: aud = ${AUDIENCE}`, t.payload.aud === AUDIENCE, JSON.stringify(t.payload.aud));
      check(`${alg}: sub = client id`, t.payload.sub === AGENT[0], t.payload.sub);
      check(`${alg}: exp in the future, iat now`, t.payload.exp > now && Math.abs(t.payload.iat - now) < 60, JSON.stringify(t.payload));
      check(`${alg}: extra claims tenant_id, roles, cube_profiles, cube_actions`,
        Object.entries(AGENT_CLAIMS).every(([k, v]) => isDeepStrictEqual(t.payload[k], v)), JSON.stringify(t.payload));
      console.log(`     header ${JSON.stringify(t.header)}`);
      console.log(`     payload ${JSON.stringify(t.payload)}`);
    }
    const noRes = await clientCredentials(issuer);
    check(`${alg}: client_credentials without resource defaults to the audience`,
      noRes.status === 200 && decode(noRes.body.access_token).payload.aud === AUDIENCE, JSON.stringify(noRes.body));
    const other = await clientCredentials(issuer, { resource: 'https://elsewhere.test' });
    check(`${alg}: another resource gives aud = that resource`,
      other.status === 200 && decode(other.body.access_token).payload.aud === 'https://elsewhere.test', JSON.stringify(other.body));
    const bad = await clientCredentials(issuer, { resource: AUDIENCE }, [AGENT[0], 'wrong']);
    check(`${alg}: wrong agent secret is refused (401 invalid_client)`, bad.status === 401 && bad.body.error === 'invalid_client', JSON.stringify(bad.body));
    const cons = await clientCredentials(issuer, { resource: AUDIENCE }, CONSOLE);
    check(`${alg}: console client may not use client_credentials`, cons.status === 400 && ['unauthorized_client', 'invalid_request'].includes(cons.body.error), JSON.stringify(cons.body));

    // PKCE is required
    const nopkce = await fetch(`${issuer}/auth?${new URLSearchParams({
      client_id: CONSOLE[0], response_type: 'code', scope: 'openid', redirect_uri: REDIRECT, state: 's',
    })}`, { redirect: 'manual' });
    const nl = nopkce.headers.get('location') || '';
    check(`${alg}: /auth without code_challenge is refused`, nl.startsWith(REDIRECT) && nl.includes('error=invalid_request') && /PKCE|code_challenge/.test(decodeURIComponent(nl)), nl);
    const badRedirect = await fetch(`${issuer}/auth?${new URLSearchParams({
      client_id: CONSOLE[0], response_type: 'code', scope: 'openid', redirect_uri: 'https://127.0.0.1:4444/x', state: 's', code_challenge: 'x'.repeat(43), code_challenge_method: 'S256',
    })}`, { redirect: 'manual' });
    check(`${alg}: unregistered redirect_uri is refused (400 page, no redirect)`, badRedirect.status === 400, badRedirect.status);

    await codeFlow(issuer, jwks, { account: 'alice', alg, signAlg: alg });

    if (rotateFile) {
      const before = JSON.parse(readFileSync(rotateFile, 'utf8'));
      check(`${alg}: rotate file written at start`, before.generation === 1 && isDeepStrictEqual(before.kids, kids), JSON.stringify(before));
      p.child.kill('SIGUSR1');
      let after;
      for (let i = 0; i < 100; i += 1) {
        await new Promise((r) => setTimeout(r, 100));
        try { after = JSON.parse(readFileSync(rotateFile, 'utf8')); } catch { after = undefined; }
        if (after?.generation === 2) break;
      }
      if (check(`${alg}: SIGUSR1 rotated (generation 2 in the file)`, after?.generation === 2, JSON.stringify(after))) {
        check(`${alg}: new kids differ from the old`, after.kids.RS256 !== kids.RS256 && after.kids.ES256 !== kids.ES256);
        const jwks2 = (await getJson(`${issuer}/jwks`)).body;
        const kids2 = jwks2.keys.map((k) => k.kid);
        check(`${alg}: JWKS now serves new and old keys (4)`, kids2.length === 4
          && [after.kids.RS256, after.kids.ES256, kids.RS256, kids.ES256].every((k) => kids2.includes(k)), JSON.stringify(kids2));
        const cc2 = await clientCredentials(issuer, { resource: AUDIENCE });
        const t2 = decode(cc2.body.access_token);
        check(`${alg}: new tokens are signed with the new kid`, t2.header.kid === after.kids[alg], JSON.stringify(t2.header));
        check(`${alg}: ... and verify against the refreshed JWKS`, verifyJwt(cc2.body.access_token, jwks2) === true);
        check(`${alg}: ... but not against the old JWKS (unknown kid)`, verifyJwt(cc2.body.access_token, jwks) !== true);
        check(`${alg}: old token still verifies against the new JWKS`, verifyJwt(cc.body.access_token, jwks2) === true);
        check(`${alg}: discovery still answers after rotation`, (await getJson(`${issuer}/.well-known/openid-configuration`)).body.issuer === issuer);
        await codeFlow(issuer, jwks2, { account: 'bob', alg: `${alg}/rotated`, signAlg: alg });
      }
    }
  } catch (e) {
    check(`${alg}: no exception`, false, e.stack);
  } finally {
    await stop(p, alg);
    if (failed) console.log(`-- provider stderr (${alg}):\n${p.stderr()}`);
  }
}

const dir = mkdtempSync(join(tmpdir(), 'oidc-smoke-'));
try {
  await run('RS256', join(dir, 'rotate.json'));
  await run('ES256');
} finally {
  rmSync(dir, { recursive: true, force: true });
}
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
