// A real OpenID Connect provider for the integration tests: oidc-provider
// (panva, OpenID Certified) on http://127.0.0.1:PORT, plain HTTP on
// loopback. Started by the Rust tests (and by smoke.mjs); not a server to
// deploy. Everything is in memory and gone when the process ends.
//
// Environment (all optional):
//   OIDC_PORT            port to bind on 127.0.0.1 (default 0 = any free port)
//   OIDC_ALG             RS256 (default) or ES256: signs ID tokens and JWT
//                        access tokens
//   OIDC_AUDIENCE        the resource server (default https://cube-adapter.test);
//                        also the resource used when client_credentials has no
//                        `resource` parameter. Any other absolute URI is
//                        accepted as `resource` too (aud = that URI), so a
//                        test can mint a token for the wrong audience.
//   OIDC_AGENT_CLIENT    / OIDC_AGENT_SECRET   machine client (client_credentials)
//                        default cube-agent / agent-secret-0123456789abcdef
//   OIDC_AGENT_AUTH_METHOD  client_secret_basic (default) or client_secret_post
//   OIDC_AGENT_CLAIMS    JSON object merged into the agent's access tokens
//   OIDC_EXTRA_AGENTS    JSON object {"client_id":{"secret":"...","claims":{...}}}:
//                        more machine clients, e.g. another tenant
//   OIDC_CONSOLE_CLIENT  / OIDC_CONSOLE_SECRET   people's client (code + PKCE S256)
//                        default cube-console / console-secret-0123456789abcdef
//   OIDC_CONSOLE_AUTH_METHOD  client_secret_basic (default) or client_secret_post
//                        (oidc-provider enforces the one registered)
//   OIDC_REDIRECT_URIS   comma separated (default
//                        https://127.0.0.1:4443/console/oidc/callback); http and
//                        https, any port, must match exactly
//   OIDC_POST_LOGOUT_REDIRECT_URIS  comma separated, for /session/end (optional)
//   OIDC_ACCOUNTS        JSON {"account id":{claims}}; any other account id
//                        signs in too and gets only `sub`. Every claim name used
//                        here is put in the ID token (mapped to scope openid).
//   OIDC_ACCESS_TTL      access token lifetime in seconds (default 600)
//   OIDC_ID_TOKEN_TTL    ID token lifetime in seconds (default 3600)
//   OIDC_ROTATE_FILE     if set, SIGUSR1 rotates the signing keys (see below)
//                        and writes the new state as JSON to this file
//   OIDC_ROTATE_MODE     add (default): new keys first, old keys stay in the
//                        JWKS; replace: only the new keys are served
//
// stdout: exactly one line once listening, then nothing:
//   {"issuer":"http://127.0.0.1:PORT","port":PORT,"kids":{"RS256":"...","ES256":"..."}}
// Everything else goes to stderr. SIGTERM/SIGINT: close and exit 0.
//
// Key rotation (OIDC_ROTATE_FILE set): on SIGUSR1 a new RSA and a new EC key
// (new kids) are generated and signing switches to them at once. The file
// gets {"generation":N,"kids":{"RS256":"...","ES256":"..."},"jwks_kids":[...]}
// (written to FILE.tmp then renamed, so a reader never sees half of it);
// wait for `generation` to change. Sessions, codes and tokens survive.
//
// Endpoints (also in discovery): /.well-known/openid-configuration, /auth,
// /token, /jwks, /me (userinfo), /token/introspection, /token/revocation,
// /session/end, /interaction/:uid (the login page).
//
// Driving the sign-in from a browser (devInteractions, oidc-provider's own
// pages; nothing on them loads from outside 127.0.0.1):
//   1. Open the relying party's login, which redirects to /auth?... and on to
//      /interaction/<uid>, a page titled "Sign-in" with ONE form:
//        input[name="login"]     type the account id (e.g. alice)
//        input[name="password"]  anything, but not empty (it is `required`)
//        button[type="submit"]   text "Sign-in" (class "login-submit")
//   2. For the console client there is NO consent page: first-party grants
//      (openid profile email + the audience) are made on the fly, so the
//      browser lands on redirect_uri?code=...&state=...&iss=... right away.
//      (For any other client a page titled "Authorize" would follow, with one
//      button[type="submit"] "Continue"; same selector.)
//   So: page.fill('input[name=login]', 'alice');
//       page.fill('input[name=password]', 'x');
//       page.click('button[type=submit]');
//   A second /auth in the same browser is answered without a form while the
//   session cookie (op_session, SameSite=Lax) lives; use prompt=login to force it.
//   Seen in Chromium 156: after the login form (posted on http://127.0.0.1:PORT,
//   another site than https://127.0.0.1:4443), the callback request does NOT
//   carry the relying party's SameSite=Strict cookies (Lax ones it does), and
//   a Strict cookie set by the callback is not sent either if the callback
//   answers 303 -> /console; a 200 page that navigates on (meta refresh) works.

import { generateKeyPairSync, randomBytes } from 'node:crypto';
import { createServer } from 'node:http';
import { renameSync, writeFileSync } from 'node:fs';

// oidc-provider prints notices with console.info: keep stdout for our line.
console.log = console.error; // eslint-disable-line no-console
console.info = console.error; // eslint-disable-line no-console
console.debug = console.error; // eslint-disable-line no-console

const log = (...a) => console.error('[oidc]', ...a); // eslint-disable-line no-console

const { default: Provider, errors } = await import('oidc-provider');

const json = (name, fallback) => {
  const raw = process.env[name];
  if (raw === undefined || raw === '') return fallback;
  try {
    return JSON.parse(raw);
  } catch (e) {
    throw new Error(`${name} is not valid JSON: ${e.message}`);
  }
};
const env = (name, fallback) => {
  const v = process.env[name];
  return v === undefined || v === '' ? fallback : v;
};
const list = (name, fallback) => env(name, fallback).split(',').map((s) => s.trim()).filter(Boolean);

const PORT = Number(env('OIDC_PORT', '0'));
const ALG = env('OIDC_ALG', 'RS256');
if (!['RS256', 'ES256'].includes(ALG)) throw new Error(`OIDC_ALG must be RS256 or ES256, not ${ALG}`);
const AUDIENCE = env('OIDC_AUDIENCE', 'https://cube-adapter.test');
const AGENT = env('OIDC_AGENT_CLIENT', 'cube-agent');
const AGENT_SECRET = env('OIDC_AGENT_SECRET', 'agent-secret-0123456789abcdef');
const AGENT_CLAIMS = json('OIDC_AGENT_CLAIMS', {
  tenant_id: 'acme',
  roles: ['runtime'],
  cube_profiles: ['offline-code'],
  cube_actions: ['lease:*', 'exec:run'],
});
const EXTRA_AGENTS = json('OIDC_EXTRA_AGENTS', {});
const CONSOLE = env('OIDC_CONSOLE_CLIENT', 'cube-console');
const CONSOLE_SECRET = env('OIDC_CONSOLE_SECRET', 'console-secret-0123456789abcdef');
const CONSOLE_AUTH = env('OIDC_CONSOLE_AUTH_METHOD', 'client_secret_basic');
const REDIRECT_URIS = list('OIDC_REDIRECT_URIS', 'https://127.0.0.1:4443/console/oidc/callback');
const LOGOUT_URIS = list('OIDC_POST_LOGOUT_REDIRECT_URIS', '');
const ACCOUNTS = json('OIDC_ACCOUNTS', {
  alice: { email: 'alice@example.test', tenant_id: 'acme', groups: ['cube-approvers'] },
  bob: { email: 'bob@example.test', tenant_id: 'acme', groups: ['cube-auditors'] },
});
const ACCESS_TTL = Number(env('OIDC_ACCESS_TTL', '600'));
const ID_TOKEN_TTL = Number(env('OIDC_ID_TOKEN_TTL', '3600'));
const ROTATE_FILE = env('OIDC_ROTATE_FILE', '');
const ROTATE_MODE = env('OIDC_ROTATE_MODE', 'add');

for (const [name, v] of [['OIDC_AGENT_CLAIMS', AGENT_CLAIMS], ['OIDC_EXTRA_AGENTS', EXTRA_AGENTS], ['OIDC_ACCOUNTS', ACCOUNTS]]) {
  if (!v || typeof v !== 'object' || Array.isArray(v)) throw new Error(`${name} must be a JSON object`);
}

// ---- keys --------------------------------------------------------------

let generation = 0;
function newKeys() {
  generation += 1;
  const tag = `${generation}-${randomBytes(4).toString('hex')}`;
  const rsa = generateKeyPairSync('rsa', { modulusLength: 2048 }).privateKey
    .export({ format: 'jwk' });
  const ec = generateKeyPairSync('ec', { namedCurve: 'P-256' }).privateKey
    .export({ format: 'jwk' });
  return [
    { ...rsa, kid: `rs256-${tag}`, alg: 'RS256', use: 'sig' },
    { ...ec, kid: `es256-${tag}`, alg: 'ES256', use: 'sig' },
  ];
}
let keys = newKeys(); // signing uses the first key of each alg
const kidsOf = (ks) => ({
  RS256: ks.find((k) => k.alg === 'RS256').kid,
  ES256: ks.find((k) => k.alg === 'ES256').kid,
});

// ---- storage: one Map shared by every Provider instance (see rotation) --

const store = new Map(); // key -> { value, exp (ms) }
const sget = (key) => {
  const e = store.get(key);
  if (!e) return undefined;
  if (e.exp && e.exp < Date.now()) {
    store.delete(key);
    return undefined;
  }
  return e.value;
};
const sset = (key, value, expiresIn) => store.set(key, {
  value,
  exp: expiresIn ? Date.now() + expiresIn * 1000 : 0,
});
setInterval(() => {
  const now = Date.now();
  for (const [k, e] of store) if (e.exp && e.exp < now) store.delete(k);
}, 60_000).unref();

const GRANTABLE = new Set(['AccessToken', 'AuthorizationCode', 'RefreshToken', 'DeviceCode', 'BackchannelAuthenticationRequest']);
class MapAdapter {
  constructor(model) { this.model = model; }

  key(id) { return `${this.model}:${id}`; }

  async upsert(id, payload, expiresIn) {
    const key = this.key(id);
    if (this.model === 'Session') sset(`sessionUid:${payload.uid}`, id, expiresIn);
    if (GRANTABLE.has(this.model) && payload.grantId) {
      const gk = `grant:${payload.grantId}`;
      const g = sget(gk);
      if (g) g.push(key); else sset(gk, [key], expiresIn);
    }
    if (payload.userCode) sset(`userCode:${payload.userCode}`, id, expiresIn);
    sset(key, payload, expiresIn);
  }

  async find(id) { return sget(this.key(id)); }

  async findByUid(uid) {
    const id = sget(`sessionUid:${uid}`);
    return id === undefined ? undefined : this.find(id);
  }

  async findByUserCode(code) {
    const id = sget(`userCode:${code}`);
    return id === undefined ? undefined : this.find(id);
  }

  async consume(id) {
    const v = sget(this.key(id));
    if (v) v.consumed = Math.floor(Date.now() / 1000);
  }

  async destroy(id) { store.delete(this.key(id)); }

  async revokeByGrantId(grantId) { // eslint-disable-line class-methods-use-this
    const gk = `grant:${grantId}`;
    for (const k of sget(gk) || []) store.delete(k);
    store.delete(gk);
  }
}

// ---- clients, accounts, claims ----------------------------------------

const agents = new Map([[AGENT, { secret: AGENT_SECRET, claims: AGENT_CLAIMS }]]);
for (const [id, a] of Object.entries(EXTRA_AGENTS)) {
  agents.set(id, { secret: a.secret ?? a.client_secret, claims: a.claims ?? {} });
}

const RESOURCE_SCOPE = 'cube';
const clients = [
  ...[...agents].map(([id, a]) => ({
    client_id: id,
    client_secret: a.secret,
    grant_types: ['client_credentials'],
    response_types: [],
    redirect_uris: [],
    token_endpoint_auth_method: 'client_secret_basic',
  })),
  {
    client_id: CONSOLE,
    client_secret: CONSOLE_SECRET,
    grant_types: ['authorization_code'],
    response_types: ['code'],
    redirect_uris: REDIRECT_URIS,
    post_logout_redirect_uris: LOGOUT_URIS,
    token_endpoint_auth_method: CONSOLE_AUTH,
    scope: 'openid profile email',
  },
];
// client_secret_post for the agents too: register it where asked
if (env('OIDC_AGENT_AUTH_METHOD', '') === 'client_secret_post') {
  for (const c of clients) if (agents.has(c.client_id)) c.token_endpoint_auth_method = 'client_secret_post';
}
const FIRST_PARTY = new Set([CONSOLE]);

const accountClaimNames = new Set();
for (const c of Object.values(ACCOUNTS)) for (const k of Object.keys(c)) accountClaimNames.add(k);
accountClaimNames.delete('sub');

const claims = {
  // everything an account has goes into the ID token with scope openid
  openid: ['sub', 'preferred_username', ...accountClaimNames],
  profile: ['preferred_username', 'name', 'given_name', 'family_name'],
  email: ['email', 'email_verified'],
  acr: null,
  sid: null,
  auth_time: null,
  iss: null,
};

async function findAccount(ctx, sub) {
  return {
    accountId: sub,
    async claims() {
      return { preferred_username: sub, ...(ACCOUNTS[sub] || {}), sub };
    },
  };
}

// ---- the provider ------------------------------------------------------

const cookieKeys = [randomBytes(32).toString('hex')];

function configuration() {
  return {
    adapter: MapAdapter,
    clients,
    findAccount,
    claims,
    scopes: ['openid', 'profile', 'email', 'offline_access'],
    conformIdTokenClaims: false, // scope claims land in the ID token itself
    responseTypes: ['code'],
    jwks: { keys },
    clientDefaults: {
      id_token_signed_response_alg: ALG,
      token_endpoint_auth_method: 'client_secret_basic',
    },
    pkce: { methods: ['S256'], required: () => true },
    cookies: {
      keys: cookieKeys,
      // cookies ignore ports: names that cannot clash with a relying party's
      names: { session: 'op_session', interaction: 'op_interaction', resume: 'op_interaction_resume' },
      // plain http on 127.0.0.1: never `secure`; SameSite=None would be
      // refused by Chromium without `secure`, so Lax for both
      long: { signed: true, httpOnly: true, sameSite: 'lax' },
      short: { signed: true, httpOnly: true, sameSite: 'lax' },
    },
    ttl: {
      AccessToken: ACCESS_TTL,
      ClientCredentials: ACCESS_TTL,
      AuthorizationCode: 60,
      IdToken: ID_TOKEN_TTL,
      Interaction: 3600,
      Session: 86400,
      Grant: 86400,
    },
    features: {
      devInteractions: { enabled: true },
      clientCredentials: { enabled: true },
      introspection: { enabled: true },
      revocation: { enabled: true },
      rpInitiatedLogout: { enabled: true },
      resourceIndicators: {
        enabled: true,
        // client_credentials without `resource` still gets a JWT for AUDIENCE
        async defaultResource(ctx, client, oneOf) {
          if (oneOf) return oneOf;
          if (ctx.oidc.params?.grant_type === 'client_credentials') return AUDIENCE;
          return undefined;
        },
        useGrantedResource: async () => true,
        async getResourceServerInfo(ctx, resource) {
          let url;
          try { url = new URL(resource); } catch { throw new errors.InvalidTarget(); }
          if (!url) throw new errors.InvalidTarget();
          return {
            scope: RESOURCE_SCOPE,
            audience: resource,
            accessTokenTTL: ACCESS_TTL,
            accessTokenFormat: 'jwt',
            jwt: { sign: { alg: ALG } },
          };
        },
      },
    },
    async extraTokenClaims(ctx, token) {
      if (token.kind === 'ClientCredentials' && agents.has(token.clientId)) {
        return structuredClone(agents.get(token.clientId).claims);
      }
      return undefined;
    },
    // first-party console: consent is implied, no "Authorize" page
    async loadExistingGrant(ctx) {
      const { client, session, provider: op } = ctx.oidc;
      const grantId = ctx.oidc.result?.consent?.grantId || session.grantIdFor(client.clientId);
      let grant = grantId ? await op.Grant.find(grantId) : undefined;
      if (!FIRST_PARTY.has(client.clientId) || !session.accountId) return grant;
      if (!grant || grant.accountId !== session.accountId) {
        grant = new op.Grant({ clientId: client.clientId, accountId: session.accountId });
      }
      grant.addOIDCScope('openid profile email');
      grant.addResourceScope(AUDIENCE, RESOURCE_SCOPE);
      let resources = ctx.oidc.params?.resource;
      if (resources && !Array.isArray(resources)) resources = [resources];
      for (const r of resources || []) grant.addResourceScope(r, RESOURCE_SCOPE);
      await grant.save();
      return grant;
    },
    clientBasedCORS: () => true,
    renderError(ctx, out) {
      ctx.type = 'html';
      const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
      ctx.body = `<!DOCTYPE html><html><head><meta charset="utf-8"><title>oops! something went wrong</title></head><body><h1>oops! something went wrong</h1>${
        Object.entries(out).map(([k, v]) => `<pre><strong>${esc(k)}</strong>: ${esc(v)}</pre>`).join('')}</body></html>`;
    },
  };
}

const server = createServer();
await new Promise((resolve, reject) => {
  server.once('error', reject);
  server.listen(PORT, '127.0.0.1', resolve);
});
const { port } = server.address();
const ISSUER = `http://127.0.0.1:${port}`;

// The built-in pages @import a Google font: drop it, so a browser under test
// talks to 127.0.0.1 only.
const FONT = /@import url\(https:\/\/fonts\.googleapis\.com\/[^)]*\);?/g;

function build() {
  const p = new Provider(ISSUER, configuration());
  p.proxy = false;
  p.use(async (ctx, next) => {
    await next();
    if (typeof ctx.body === 'string' && ctx.body.includes('fonts.googleapis.com')) {
      ctx.body = ctx.body.replace(FONT, '');
    }
  });
  for (const ev of ['server_error', 'authorization.error', 'grant.error', 'introspection.error',
    'revocation.error', 'end_session.error', 'userinfo.error', 'jwks.error', 'discovery.error',
    'check_session_origin.error', 'registration_create.error']) {
    p.on(ev, (ctx, err) => log(ev, err?.name, err?.message, err?.error_description ?? ''));
  }
  return p;
}

let provider = build();
let handler = provider.callback();
server.on('request', (req, res) => handler(req, res));
server.keepAliveTimeout = 1000;

function writeRotateFile() {
  if (!ROTATE_FILE) return;
  const body = `${JSON.stringify({ generation, kids: kidsOf(keys), jwks_kids: keys.map((k) => k.kid) })}\n`;
  writeFileSync(`${ROTATE_FILE}.tmp`, body);
  renameSync(`${ROTATE_FILE}.tmp`, ROTATE_FILE);
}

// Installing a SIGUSR1 listener also stops Node from starting its inspector
// on that signal.
process.on('SIGUSR1', () => {
  if (!ROTATE_FILE) {
    log('SIGUSR1 ignored: OIDC_ROTATE_FILE is not set');
    return;
  }
  try {
    const fresh = newKeys();
    keys = ROTATE_MODE === 'replace' ? fresh : [...fresh, ...keys];
    provider = build();
    handler = provider.callback();
    writeRotateFile();
    log(`rotated keys (${ROTATE_MODE}): now signing with`, JSON.stringify(kidsOf(keys)));
  } catch (e) {
    log('rotation failed:', e.stack || e);
  }
});

let closing = false;
function shutdown(sig) {
  if (closing) return;
  closing = true;
  log(`${sig}: closing`);
  server.close(() => process.exit(0));
  server.closeAllConnections();
  setTimeout(() => process.exit(0), 2000).unref();
}
process.on('SIGTERM', () => shutdown('SIGTERM'));
process.on('SIGINT', () => shutdown('SIGINT'));

writeRotateFile();
log(`issuer ${ISSUER}, alg ${ALG}, audience ${AUDIENCE}, clients ${clients.map((c) => c.client_id).join(' ')}, `
  + `kids ${keys.map((k) => k.kid).join(' ')}`);
process.stdout.write(`${JSON.stringify({ issuer: ISSUER, port, kids: kidsOf(keys) })}\n`);
