// Checks rendered kustomize overlays offline: every object against
// Kubernetes' schemas (npm kubernetes-models), fields the schema does not
// know, and what the schemas cannot see (ports, volumes, Secrets, the
// pairing of training jobs with cohortd). Run by deploy/kustomize_test.sh:
//
//   node validate.js --tools DIR --workspace ROOT NAME=RENDERED.yaml ...
//
// DIR holds node_modules with kubernetes-models and yaml; ROOT is the
// source tree (deploy/k8s/README.md, deploy/Dockerfile, BUILD files).
// Prints one line per problem and exits 1 if there is any.
"use strict";

const fs = require("fs");
const path = require("path");
const { pathToFileURL } = require("url");

const problems = [];
function problem(where, what) {
  problems.push(`${where}: ${what}`);
}

function parseArgs(argv) {
  const out = { tools: "", workspace: "", renders: [] };
  for (let i = 0; i < argv.length; ++i) {
    if (argv[i] === "--tools") out.tools = argv[++i];
    else if (argv[i] === "--workspace") out.workspace = argv[++i];
    else {
      const eq = argv[i].indexOf("=");
      if (eq < 1) throw new Error(`bad argument '${argv[i]}'`);
      out.renders.push({ name: argv[i].slice(0, eq), file: argv[i].slice(eq + 1) });
    }
  }
  if (!out.tools || !out.workspace || out.renders.length === 0) {
    throw new Error("usage: validate.js --tools DIR --workspace ROOT NAME=FILE...");
  }
  return out;
}

// ---- Schemas -------------------------------------------------------------

// The model class of apiVersion/kind, or null when kubernetes-models has
// none (an unknown kind, a typo'ed apiVersion).
async function modelClass(tools, apiVersion, kind) {
  if (!/^[A-Za-z0-9.\-/]+$/.test(apiVersion) || !/^[A-Za-z]+$/.test(kind)) return null;
  const file = path.join(tools, "node_modules/kubernetes-models", apiVersion, `${kind}.js`);
  if (!fs.existsSync(file)) return null;
  const module = await import(pathToFileURL(file).href);
  return module[kind] || null;
}

// The paths of fields in `object` that the schema validator never looked
// at: unknown to the schema, so a typo (kubernetes-models, like the JSON
// schemas it is built from, allows additional properties). Map-valued
// fields (labels, resources.limits) are enumerated by the validator and so
// count as known.
function unknownFields(validate, object) {
  const read = new Map();
  const enumerated = new Set();
  const wrap = (value, at) => {
    if (value === null || typeof value !== "object") return value;
    if (!read.has(at)) read.set(at, new Set());
    return new Proxy(value, {
      get(target, key, receiver) {
        if (typeof key === "string") read.get(at).add(key);
        return wrap(Reflect.get(target, key, receiver), `${at}.${String(key)}`);
      },
      has(target, key) {
        if (typeof key === "string") read.get(at).add(key);
        return Reflect.has(target, key);
      },
      ownKeys(target) {
        enumerated.add(at);
        return Reflect.ownKeys(target);
      },
    });
  };
  try {
    validate.call(wrap(object, ""));
  } catch (e) {
    // Schema errors are reported by the plain validation.
  }
  const unknown = [];
  const walk = (value, at) => {
    if (Array.isArray(value)) {
      value.forEach((v, i) => walk(v, `${at}.${i}`));
      return;
    }
    if (value === null || typeof value !== "object") return;
    const known = read.get(at);
    for (const key of Object.keys(value)) {
      if (!enumerated.has(at) && !(known && known.has(key))) {
        unknown.push(`${at}.${key}`.slice(1));
      } else {
        walk(value[key], `${at}.${key}`);
      }
    }
  };
  walk(object, "");
  return unknown;
}

// ---- Helpers over rendered objects ----------------------------------------

const kWorkloads = new Set(["StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Job"]);

function podTemplate(o) {
  return kWorkloads.has(o.kind) && o.spec && o.spec.template ? o.spec.template : null;
}

// A Service's selector is a plain map; one without any selects nothing.
function serviceSelects(service, labels) {
  const selector = service.spec.selector || {};
  return Object.keys(selector).length > 0 && labelsMatch({ matchLabels: selector }, labels);
}

function labelsMatch(selector, labels) {
  if (!selector) return false;
  if (selector.matchExpressions) {
    throw new Error("validate.js does not evaluate matchExpressions; add it here");
  }
  return Object.entries(selector.matchLabels || {}).every(([k, v]) => (labels || {})[k] === v);
}

// "--name=value" flags of an argument list, up to "--".
function flags(args) {
  const out = new Map();
  for (const a of args || []) {
    if (a === "--") break;
    const m = /^--([A-Za-z0-9_-]+)(?:=(.*))?$/.exec(a);
    if (m) out.set(m[1].replace(/-/g, "_"), m[2] === undefined ? "true" : m[2]);
  }
  return out;
}

function afterDashes(args) {
  const i = (args || []).indexOf("--");
  return i < 0 ? [] : args.slice(i + 1);
}

function portOf(hostPort) {
  const m = /:(\d+)$/.exec(hostPort || "");
  return m ? Number(m[1]) : null;
}

function seconds(duration) {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)$/.exec(duration);
  if (!m) return null;
  return Number(m[1]) * { ms: 0.001, s: 1, m: 60, h: 3600 }[m[2]];
}

// Images not built here, by repository: the tag each must be pinned to
// exactly (a release, not a moving tag). overlays/ha runs etcd 3.4, as
// Debian's etcd-server.
const kThirdPartyImages = new Map([
  ["quay.io/coreos/etcd", /^v3\.\d+\.\d+$/],
  ["gcr.io/etcd-development/etcd", /^v3\.\d+\.\d+$/],
  ["registry.k8s.io/etcd", /^3\.\d+\.\d+-\d+$/],
]);

function imageTag(image) {
  const m = /:([^/:@]+)(?:@.*)?$/.exec(image);
  return m ? m[1] : "";
}

function isEtcdImage(image) {
  return path.basename(imageRepo(image || "")) === "etcd" && kThirdPartyImages.has(imageRepo(image));
}

function imageRepo(image) {
  return image.replace(/@.*$/, "").replace(/:[^/:]+$/, "");
}

// The container port `port` (a number or a name) names, or null.
function containerPort(container, port) {
  for (const p of container.ports || []) {
    if (p.containerPort === port || (p.name && p.name === port)) return p;
  }
  return null;
}

// ---- What lives outside the render ---------------------------------------

// Secrets and ConfigMaps that README's `kubectl create` commands make, with
// the keys they get.
function documentedObjects(readme) {
  const text = readme.replace(/\\\n\s*/g, " ");
  const out = { Secret: new Map(), ConfigMap: new Map() };
  const re = /kubectl\s+(?:-n\s+\S+\s+)?create\s+(secret\s+(generic|tls)|configmap)\s+([a-z0-9.-]+)([^\n]*)/g;
  for (let m; (m = re.exec(text)); ) {
    const kind = m[1].startsWith("secret") ? "Secret" : "ConfigMap";
    const keys = new Set(m[2] === "tls" ? ["tls.crt", "tls.key"] : []);
    for (const f of m[4].matchAll(/--from-(file|literal)=([^\s=]+)(=?)/g)) {
      keys.add(f[3] === "=" ? f[2] : path.basename(f[2]));
    }
    out[kind].set(m[3], keys);
  }
  return out;
}

function dockerfileStages(dockerfile) {
  const stages = new Set();
  for (const m of dockerfile.matchAll(/^FROM\s+\S+\s+AS\s+(\S+)/gim)) stages.add(m[1]);
  return stages;
}

function checkDockerfile(workspace) {
  const where = "deploy/Dockerfile";
  const text = fs.readFileSync(path.join(workspace, where), "utf8");
  for (const m of text.matchAll(/^FROM\s+(\S+)/gim)) {
    if (!/:[^/]+$/.test(m[1]) && !m[1].includes("@")) problem(where, `base image ${m[1]} has no tag`);
  }
  // Every binary copied out of bazel-bin is a target the build names and a
  // rule of its package's BUILD file.
  const built = new Set();
  for (const m of text.matchAll(/bazel build ((?:\/\/[\w/]+:[\w.]+\s*(?:\\\s*)?)+)/g)) {
    for (const label of m[1].match(/\/\/[\w/]+:[\w.]+/g)) built.add(label);
  }
  if (built.size === 0) problem(where, "no `bazel build //...` command found");
  for (const label of built) {
    const [pkg, name] = label.slice(2).split(":");
    const build = path.join(workspace, pkg, "BUILD");
    const rules = fs.existsSync(build) ? fs.readFileSync(build, "utf8") : "";
    if (!new RegExp(`cc_binary\\(\\s*name = "${name.replace(/\./g, "\\.")}"`).test(rules)) {
      problem(where, `builds ${label}, but ${pkg}/BUILD has no cc_binary named "${name}"`);
    }
  }
  for (const m of text.matchAll(/bazel-bin\/([\w/]+)\/([\w.]+)/g)) {
    if (!built.has(`//${m[1]}:${m[2]}`)) {
      problem(where, `copies bazel-bin/${m[1]}/${m[2]}, which its bazel build does not build`);
    }
  }
  return dockerfileStages(text);
}

// `docker build ... --target X` in the manifests' comments names a stage.
function checkImageComments(workspace, stages) {
  const root = path.join(workspace, "deploy/k8s");
  const files = [];
  const walk = (dir) => {
    for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
      const p = path.join(dir, e.name);
      if (e.isDirectory()) walk(p);
      else if (e.name.endsWith(".yaml")) files.push(p);
    }
  };
  walk(root);
  for (const f of files) {
    for (const m of fs.readFileSync(f, "utf8").matchAll(/--target[ =](\S+)/g)) {
      if (!stages.has(m[1])) {
        problem(path.relative(workspace, f), `names Dockerfile target '${m[1]}', which is no stage`);
      }
    }
  }
}

// ---- Per-render checks ----------------------------------------------------

function checkContainer(where, o, pod, c, ctx) {
  const at = `${where} container ${c.name}`;
  const spec = pod.spec;
  // Images: pinned, and built by a Dockerfile stage of the same name.
  if (!c.image || (!c.image.includes("@") && !/:[^/:]+$/.test(c.image))) {
    problem(at, `image '${c.image}' is not pinned to a tag`);
  } else if (/:latest$/.test(c.image)) {
    problem(at, `image '${c.image}' uses :latest`);
  }
  if (c.image && kThirdPartyImages.has(imageRepo(c.image))) {
    if (!kThirdPartyImages.get(imageRepo(c.image)).test(imageTag(c.image))) {
      problem(at, `image '${c.image}' is not pinned to a release tag (${kThirdPartyImages.get(imageRepo(c.image))})`);
    }
  } else if (c.image && !ctx.stages.has(path.basename(imageRepo(c.image)))) {
    problem(at, `image '${c.image}': deploy/Dockerfile has no stage '${path.basename(imageRepo(c.image))}'`);
  }
  // Probes aim at declared ports.
  for (const probe of ["livenessProbe", "readinessProbe", "startupProbe"]) {
    const p = c[probe];
    if (!p) continue;
    const port = (p.grpc || p.httpGet || p.tcpSocket || {}).port;
    if (port !== undefined && !containerPort(c, port)) {
      problem(at, `${probe} port ${port} is not among its containerPorts`);
    }
  }
  // Volumes: every mount names a volume, no path mounted twice.
  const volumes = new Map((spec.volumes || []).map((v) => [v.name, v]));
  for (const t of (o.spec && o.spec.volumeClaimTemplates) || []) {
    volumes.set(t.metadata.name, { persistentVolumeClaim: {} });
  }
  const mountPaths = new Set();
  for (const m of c.volumeMounts || []) {
    if (!volumes.has(m.name)) problem(at, `volumeMount ${m.mountPath} names no volume '${m.name}'`);
    if (mountPaths.has(m.mountPath)) problem(at, `${m.mountPath} is mounted twice`);
    mountPaths.add(m.mountPath);
  }
  // Environment: $(VAR) refers to a variable defined before it.
  const defined = new Set();
  for (const e of c.env || []) {
    for (const r of (e.value || "").matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
      if (!defined.has(r[1])) problem(at, `env ${e.name} uses $(${r[1]}), not defined before it`);
    }
    defined.add(e.name);
  }
  for (const a of [...(c.command || []), ...(c.args || [])]) {
    for (const r of a.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
      if (!defined.has(r[1])) problem(at, `'${a}' uses $(${r[1]}), which its env does not define`);
    }
  }
  // Secrets and ConfigMaps referenced exist, with the keys used.
  for (const e of c.env || []) {
    const ref = e.valueFrom && (e.valueFrom.secretKeyRef || e.valueFrom.configMapKeyRef);
    if (!ref) continue;
    const kind = e.valueFrom.secretKeyRef ? "Secret" : "ConfigMap";
    ctx.needKeys(at, kind, ref.name, [ref.key], ref.optional);
  }
  // Files named by flags and env live in the mounted volumes that hold them.
  const files = [];
  const f = flags(c.args);
  for (const flag of ["tls_cert", "tls_key", "tls_client_ca", "auth_tokens"]) {
    if (f.has(flag)) files.push([`--${flag}`, f.get(flag)]);
  }
  for (const e of c.env || []) {
    if (/^COHORT_(TLS_CA|TLS_CERT|TLS_KEY|TOKEN_FILE)$/.test(e.name)) files.push([e.name, e.value]);
  }
  for (const a of afterDashes(c.args)) if (/\.py$/.test(a)) files.push(["the program", a]);
  for (const [what, file] of files) {
    const mount = (c.volumeMounts || []).find((m) => (file || "").startsWith(m.mountPath.replace(/\/?$/, "/")));
    if (!mount) {
      problem(at, `${what}=${file} is under no volumeMount (the image holds no such file)`);
      continue;
    }
    const v = volumes.get(mount.name);
    const rel = file.slice(mount.mountPath.replace(/\/?$/, "/").length);
    const source = v && (v.secret || v.configMap);
    if (!source) continue;
    const kind = v.secret ? "Secret" : "ConfigMap";
    const name = v.secret ? v.secret.secretName : v.configMap.name;
    if (source.items) {
      const item = source.items.find((i) => i.path === rel);
      if (!item) problem(at, `${what}=${file}: ${kind} volume '${mount.name}' has no item at ${rel}`);
    } else {
      ctx.needKeys(at, kind, name, [rel], source.optional);
    }
  }
  // Hardening and sizing.
  const sc = c.securityContext || {};
  const podSc = spec.securityContext || {};
  if (!(sc.runAsNonRoot || podSc.runAsNonRoot)) problem(at, "does not set runAsNonRoot");
  if (!sc.readOnlyRootFilesystem) problem(at, "root filesystem is not read-only");
  if (sc.allowPrivilegeEscalation !== false) problem(at, "allows privilege escalation");
  if (!(sc.capabilities && (sc.capabilities.drop || []).includes("ALL"))) problem(at, "does not drop ALL capabilities");
  const r = c.resources || {};
  if (!(r.requests && r.requests.memory && r.requests.cpu)) problem(at, "has no cpu and memory requests");
  if (!(r.limits && r.limits.memory)) problem(at, "has no memory limit");
}

// cohortd's effective listeners, as its flags' defaults make them.
function cohortdConfig(c) {
  const f = flags(c.args);
  const auth = f.has("auth_tokens");
  const tcpstore = f.has("tcpstore_listen") ? f.get("tcpstore_listen") : auth ? "" : "0.0.0.0:29400";
  return {
    flags: f,
    tls: f.has("tls_cert"),
    mtls: f.has("tls_client_ca"),
    auth,
    grpcPort: portOf(f.has("listen") ? f.get("listen") : "0.0.0.0:29500"),
    tcpstorePort: tcpstore ? portOf(tcpstore) : null,
    metricsPort: f.has("metrics_listen") ? portOf(f.get("metrics_listen")) : null,
    healthPort: f.has("health_listen") ? portOf(f.get("health_listen")) : null,
    grace: seconds(f.has("shutdown_grace") ? f.get("shutdown_grace") : "5s"),
  };
}

function checkCohortd(where, o, c, render) {
  const at = `${where} container ${c.name}`;
  const cfg = cohortdConfig(c);
  const pod = o.spec.template;
  for (const [what, port] of [["--listen", cfg.grpcPort], ["TCPStore", cfg.tcpstorePort],
                              ["--metrics_listen", cfg.metricsPort], ["--health_listen", cfg.healthPort]]) {
    if (port !== null && !containerPort(c, port)) problem(at, `${what} port ${port} is not a containerPort`);
  }
  if (cfg.tls !== cfg.flags.has("tls_key")) problem(at, "--tls_cert and --tls_key go together");
  if (cfg.mtls && !cfg.tls) problem(at, "--tls_client_ca without --tls_cert");
  // gRPC probes speak plaintext: on a TLS port they fail.
  const healthPort = cfg.healthPort !== null ? cfg.healthPort : cfg.tls ? null : cfg.grpcPort;
  for (const [probe, service] of [["livenessProbe", "liveness"], ["readinessProbe", "liveness"]]) {
    const p = c[probe];
    if (!p || !p.grpc) {
      problem(at, `has no gRPC ${probe}`);
      continue;
    }
    const port = containerPort(c, p.grpc.port);
    if (!port || port.containerPort !== healthPort) {
      problem(at, `${probe} port ${p.grpc.port} is not a plaintext health port (--health_listen${cfg.tls ? ", as --listen serves TLS" : ""})`);
    }
    if ((p.grpc.service || "") !== service) problem(at, `${probe} should ask for service "${service}"`);
  }
  // Under auth the TCPStore listener checks a token hello against prefix +
  // namespace; job tokens cover /cohortrun/<job>/, so a prefix in front
  // locks every job out. Without tokens it needs the other two limits.
  if (cfg.auth && cfg.tcpstorePort !== null) {
    const requireToken = cfg.flags.get("tcpstore_require_token") !== "false";
    if (requireToken && cfg.flags.get("tcpstore_prefix")) {
      problem(at, "--tcpstore_prefix with token hellos required: no job token covers the prefixed namespaces, so cohortrun's proxies are refused");
    }
    if (!requireToken && !(cfg.flags.get("tcpstore_allow") && cfg.flags.get("tcpstore_prefix"))) {
      problem(at, "serves anonymous TCPStore clients under auth without --tcpstore_allow and --tcpstore_prefix");
    }
  }
  if (cfg.metricsPort !== null) {
    const a = (pod.metadata && pod.metadata.annotations) || {};
    if (a["prometheus.io/scrape"] !== "true" || a["prometheus.io/port"] !== String(cfg.metricsPort) ||
        a["prometheus.io/path"] !== "/metrics") {
      problem(where, `pod annotations prometheus.io/{scrape,port,path} do not say "true", "${cfg.metricsPort}", "/metrics"`);
    }
  }
  const grace = pod.spec.terminationGracePeriodSeconds;
  if (grace === undefined || cfg.grace === null || grace < cfg.grace + 5) {
    problem(where, `terminationGracePeriodSeconds ${grace} leaves no room after --shutdown_grace (${cfg.grace}s) to close the store`);
  }
  const engine = cfg.flags.get("engine") || "rocksdb";
  if (engine === "etcd") {
    checkCohortdOnEtcd(where, o, c, cfg, render);
  } else if (engine === "rocksdb") {
    // One RocksDB, one writer: replicas would each keep their own store.
    if (o.kind !== "StatefulSet" || o.spec.replicas !== 1) {
      problem(where, `--engine=rocksdb runs as a StatefulSet of 1 replica (a store each replica would not share), not a ${o.kind} of ${o.spec.replicas}`);
    }
    const dataDir = cfg.flags.get("data_dir") || "./cohort-data";
    if (!(c.volumeMounts || []).some((m) => m.mountPath === dataDir)) {
      problem(at, `--data_dir=${dataDir} is not a mounted volume`);
    }
  } else if (engine !== "memory") {
    problem(at, `--engine=${engine} is none of rocksdb, memory, etcd`);
  }
  // The NetworkPolicy of this render selects these pods and lets training
  // pods reach the ports they use.
  const policies = render.objects.filter((p) => p.kind === "NetworkPolicy" && labelsMatch(p.spec.podSelector, pod.metadata.labels));
  if (policies.length === 0) problem(where, "no NetworkPolicy selects cohortd's pods");
  for (const p of policies) {
    for (const rule of p.spec.ingress || []) {
      for (const port of rule.ports || []) {
        if (!containerPort(c, port.port)) problem(`${render.name} NetworkPolicy ${p.metadata.name}`, `port ${port.port} is not a cohortd containerPort`);
      }
    }
  }
  if (!render.objects.some((p) => p.kind === "PodDisruptionBudget" && labelsMatch(p.spec.selector, pod.metadata.labels))) {
    problem(where, "no PodDisruptionBudget selects cohortd's pods");
  }
  return { name: o.metadata.name, namespace: o.metadata.namespace, render, cfg, pod, policies };
}

// Whether env NAME of container c comes from the downward API's fieldPath.
function fromField(c, name, fieldPath) {
  const e = (c.env || []).find((x) => x.name === name);
  return Boolean(e && e.valueFrom && e.valueFrom.fieldRef && e.valueFrom.fieldRef.fieldPath === fieldPath);
}

// "$(POD_NAMESPACE)" (from the downward API) or the render's namespace.
function namespaceOk(c, o, ns) {
  return ns === o.metadata.namespace || (ns === "$(POD_NAMESPACE)" && fromField(c, "POD_NAMESPACE", "metadata.namespace"));
}

// The NetworkPolicies of a render that select pods labelled `labels`.
function policiesOf(render, labels) {
  return render.objects.filter((p) => p.kind === "NetworkPolicy" && labelsMatch(p.spec.podSelector, labels));
}

function pdbOf(render, labels) {
  return render.objects.find((p) => p.kind === "PodDisruptionBudget" && labelsMatch(p.spec.selector, labels));
}

// etcd's members: a StatefulSet of an odd number >= 3 of etcd members that
// bootstrap from their stable DNS names, with a volume each, probes on
// /health, a majority PDB and a NetworkPolicy. Returns what cohortd's
// check needs, or null.
const etcdChecked = new Map();
function checkEtcd(where, o, c, render) {
  if (!etcdChecked.has(o)) etcdChecked.set(o, checkEtcdOnce(where, o, c, render));
  return etcdChecked.get(o);
}

function checkEtcdOnce(where, o, c, render) {
  const at = `${where} container ${c.name}`;
  const f = new Map();
  for (const a of [...(c.command || []).slice(1), ...(c.args || [])]) {
    const m = /^--([a-z0-9-]+)(?:=(.*))?$/.exec(a);
    if (m) f.set(m[1], m[2] === undefined ? "true" : m[2]);
  }
  const replicas = o.spec.replicas === undefined ? 1 : o.spec.replicas;
  const pod = o.spec.template;
  const labels = pod.metadata.labels;
  if (replicas < 3 || replicas % 2 === 0) {
    problem(where, `etcd has ${replicas} members: an odd number of 3 or more keeps a quorum through the loss of one`);
  }
  if (o.spec.podManagementPolicy !== "Parallel") {
    problem(where, "etcd members must start in parallel (podManagementPolicy: Parallel): member 0 is not ready until a quorum has met");
  }
  const urlPort = (flag) => {
    const m = /^https?:\/\/[^/]+:(\d+)$/.exec(f.get(flag) || "");
    return m ? Number(m[1]) : null;
  };
  const clientPort = urlPort("listen-client-urls");
  const peerPort = urlPort("listen-peer-urls");
  for (const [flag, port] of [["listen-client-urls", clientPort], ["listen-peer-urls", peerPort]]) {
    if (port === null) problem(at, `--${flag}=${f.get(flag)} is not one http(s)://HOST:PORT`);
    else if (!containerPort(c, port)) problem(at, `--${flag} port ${port} is not a containerPort`);
  }
  if (f.get("name") !== "$(POD_NAME)" || !fromField(c, "POD_NAME", "metadata.name")) {
    problem(at, "--name is not $(POD_NAME) from metadata.name: members would not match --initial-cluster");
  }
  const headless = render.objects.find((s) => s.kind === "Service" && s.metadata.name === o.spec.serviceName);
  if (headless && !headless.spec.publishNotReadyAddresses) {
    problem(`${render.name} Service ${headless.metadata.name}`, "etcd's headless Service must publishNotReadyAddresses: members resolve each other before any is ready");
  }
  const dns = (member, port) => `http://${member}.${o.spec.serviceName}.$(POD_NAMESPACE).svc:${port}`;
  const want = [];
  for (let i = 0; i < replicas; ++i) want.push(`${o.metadata.name}-${i}=${dns(`${o.metadata.name}-${i}`, peerPort)}`);
  const have = (f.get("initial-cluster") || "").split(",").map((x) => x.replace(`.${o.metadata.namespace}.svc:`, ".$(POD_NAMESPACE).svc:"));
  if (have.join(",") !== want.join(",")) {
    problem(at, `--initial-cluster=${f.get("initial-cluster")} does not list the ${replicas} members by their stable names (${want.join(",")})`);
  }
  if (!fromField(c, "POD_NAMESPACE", "metadata.namespace") && have.some((x) => x.includes("$(POD_NAMESPACE)"))) {
    problem(at, "--initial-cluster uses $(POD_NAMESPACE), not from metadata.namespace");
  }
  if (f.get("initial-advertise-peer-urls") !== dns("$(POD_NAME)", peerPort)) {
    problem(at, `--initial-advertise-peer-urls=${f.get("initial-advertise-peer-urls")} is not ${dns("$(POD_NAME)", peerPort)}`);
  }
  if (f.get("initial-cluster-state") !== "new") problem(at, "--initial-cluster-state is not new");
  const dataDir = f.get("data-dir") || "";
  const claims = new Set(((o.spec.volumeClaimTemplates) || []).map((t) => t.metadata.name));
  const mount = (c.volumeMounts || []).find((m) => dataDir === m.mountPath || dataDir.startsWith(m.mountPath.replace(/\/?$/, "/")));
  if (!mount || !claims.has(mount.name)) problem(at, `--data-dir=${dataDir} is not on a volumeClaimTemplate's volume`);
  for (const probe of ["livenessProbe", "readinessProbe"]) {
    const g = c[probe] && c[probe].httpGet;
    const port = g && containerPort(c, g.port);
    if (!g || g.path !== "/health" || !port || port.containerPort !== clientPort || (g.scheme || "HTTP") !== "HTTP") {
      problem(at, `${probe} is not an HTTP GET of /health on the clients' port ${clientPort}`);
    }
  }
  const pdb = pdbOf(render, labels);
  const majority = Math.floor(replicas / 2) + 1;
  if (!pdb) problem(where, "no PodDisruptionBudget selects etcd's members");
  else if (pdb.spec.minAvailable !== majority) {
    problem(`${render.name} PodDisruptionBudget ${pdb.metadata.name}`, `minAvailable ${pdb.spec.minAvailable} is not etcd's quorum ${majority} of ${replicas}`);
  }
  const policies = policiesOf(render, labels);
  if (policies.length === 0) problem(where, "no NetworkPolicy selects etcd's members");
  else if (!admits(policies, labels, peerPort)) problem(where, `etcd's NetworkPolicy does not let members reach each other on ${peerPort}`);
  return { name: o.metadata.name, serviceName: o.spec.serviceName, replicas, clientPort, labels, policies };
}

// cohortd over etcd: stateless replicas (a Deployment, no volume) that name
// a rendered etcd, advertise their pod IP to each other, reach each other
// and etcd, and no one else reaches etcd.
function checkCohortdOnEtcd(where, o, c, cfg, render) {
  const at = `${where} container ${c.name}`;
  const pod = o.spec.template;
  const labels = pod.metadata.labels;
  const replicas = o.spec.replicas === undefined ? 1 : o.spec.replicas;
  if (o.kind !== "Deployment") problem(where, `--engine=etcd replicas keep no state: a Deployment, not a ${o.kind}`);
  if ((o.spec.volumeClaimTemplates || []).length > 0 || (pod.spec.volumes || []).some((v) => v.persistentVolumeClaim)) {
    problem(where, "--engine=etcd keeps no state, but has a PersistentVolumeClaim");
  }
  if (cfg.flags.has("data_dir")) problem(at, "--data_dir has no use with --engine=etcd");
  if (cfg.tls) problem(at, "--engine=etcd with --tls_cert: cohortd refuses it (not supported yet)");
  if (replicas < 2) problem(where, `--engine=etcd with ${replicas} replica: nothing to fail over to`);
  const pdb = pdbOf(render, labels);
  if (pdb && pdb.spec.minAvailable !== undefined && pdb.spec.minAvailable >= replicas) {
    problem(`${render.name} PodDisruptionBudget ${pdb.metadata.name}`, `minAvailable ${pdb.spec.minAvailable} of ${replicas} replicas blocks every drain`);
  }
  // The etcd members it names, all of one rendered etcd StatefulSet.
  const etcds = [];
  for (const s of render.objects) {
    if (s.kind !== "StatefulSet") continue;
    const ec = s.spec.template.spec.containers.find((x) => isEtcdImage(x.image));
    if (ec) etcds.push({ sts: s, c: ec });
  }
  const endpoints = (cfg.flags.get("etcd_endpoints") || "").split(",").filter((e) => e);
  if (endpoints.length === 0) problem(at, "--engine=etcd without --etcd_endpoints");
  const named = new Set();
  let etcd = null;
  for (const e of endpoints) {
    // MEMBER.SERVICE.NS.svc:PORT (a member's stable name) or SERVICE.NS.svc:PORT.
    const m = /^(?:([a-z0-9-]+)\.)?([a-z0-9-]+)\.(\$\(POD_NAMESPACE\)|[a-z0-9-]+)\.svc(?:\.cluster\.local)?:(\d+)$/.exec(e);
    if (!m) {
      problem(at, `--etcd_endpoints: '${e}' is not [MEMBER.]SERVICE.$(POD_NAMESPACE).svc:PORT`);
      continue;
    }
    const [, member, serviceName, ns, port] = m;
    if (!namespaceOk(c, o, ns)) problem(at, `--etcd_endpoints: '${e}' is not in this namespace`);
    const service = render.objects.find((s) => s.kind === "Service" && s.metadata.name === serviceName);
    if (!service) {
      problem(at, `--etcd_endpoints: no Service '${serviceName}' in this overlay`);
      continue;
    }
    const sp = (service.spec.ports || []).find((p) => p.port === Number(port));
    const backend = etcds.find((x) => serviceSelects(service, x.sts.spec.template.metadata.labels));
    if (!backend) {
      problem(at, `--etcd_endpoints: Service ${serviceName} selects no etcd StatefulSet of this overlay`);
      continue;
    }
    const info = checkEtcd(`${render.name} StatefulSet ${backend.sts.metadata.name}`, backend.sts, backend.c, render);
    if (etcd && etcd.name !== info.name) problem(at, "--etcd_endpoints name two etcd clusters");
    etcd = info;
    const target = sp && (sp.targetPort === undefined ? sp.port : sp.targetPort);
    const tp = sp && containerPort(backend.c, target);
    if (!sp || !tp || tp.containerPort !== info.clientPort) {
      problem(at, `--etcd_endpoints: Service ${serviceName} port ${port} is not etcd's clients' port ${info.clientPort}`);
    }
    if (member !== undefined) {
      const mm = new RegExp(`^${info.name}-(\\d+)$`).exec(member);
      if (serviceName !== info.serviceName || service.spec.clusterIP !== "None") {
        problem(at, `--etcd_endpoints: '${e}': member names resolve through the StatefulSet's headless Service ${info.serviceName}`);
      } else if (!mm || Number(mm[1]) >= info.replicas) {
        problem(at, `--etcd_endpoints: '${e}' names no member of the ${info.replicas} of StatefulSet ${info.name}`);
      } else named.add(Number(mm[1]));
    } else if (service.spec.clusterIP === "None") {
      problem(at, `--etcd_endpoints: '${e}' is the headless Service: name its members or the clients' Service`);
    } else named.add("all");
  }
  if (etcd && !named.has("all") && named.size !== etcd.replicas) {
    problem(at, `--etcd_endpoints names ${named.size} of etcd's ${etcd.replicas} members: it could not fail over to the others`);
  }
  // --advertise: this pod's IP, on the gRPC port.
  const adv = cfg.flags.get("advertise") || "";
  if (adv !== `$(POD_IP):${cfg.grpcPort}` || !fromField(c, "POD_IP", "status.podIP")) {
    problem(at, `--advertise=${adv} is not $(POD_IP):${cfg.grpcPort} with POD_IP from status.podIP: followers could not reach the leader`);
  }
  const ttl = seconds(cfg.flags.get("election_ttl") || "3s");
  const grace = pod.spec.terminationGracePeriodSeconds;
  if (ttl === null || grace === undefined || ttl >= grace) {
    problem(where, `--election_ttl=${cfg.flags.get("election_ttl")} is not less than terminationGracePeriodSeconds ${grace}`);
  }
  // Replicas reach each other (followers pass calls to the leader) and
  // etcd; training pods reach gRPC and the TCPStore; no one else reaches etcd.
  const policies = policiesOf(render, labels);
  if (!admits(policies, labels, cfg.grpcPort)) {
    problem(where, `cohortd's NetworkPolicy does not let replicas reach each other on ${cfg.grpcPort}`);
  }
  const training = { "cohort.dev/role": "training" };
  for (const port of [cfg.grpcPort, cfg.tcpstorePort]) {
    if (port !== null && !admits(policies, training, port)) problem(where, `cohortd's NetworkPolicy does not admit training pods to ${port}`);
  }
  if (etcd) {
    if (etcd.policies.length === 0 || !admits(etcd.policies, labels, etcd.clientPort)) {
      problem(where, `etcd's NetworkPolicy does not admit cohortd's pods to ${etcd.clientPort}`);
    }
    for (const p of etcd.policies) {
      for (const rule of p.spec.ingress || []) {
        if (rule.ports && !rule.ports.some((x) => x.port === etcd.clientPort || x.port === "client")) continue;
        const onlyCohortd = (rule.from || []).length > 0 && rule.from.every((peer) => !peer.namespaceSelector && !peer.ipBlock &&
            peer.podSelector && Object.keys(peer.podSelector.matchLabels || {}).length > 0 && labelsMatch(peer.podSelector, labels));
        if (!onlyCohortd) problem(`${render.name} NetworkPolicy ${p.metadata.name}`, `lets others than cohortd's pods reach etcd's clients' port ${etcd.clientPort}`);
      }
    }
  }
}

// Whether `policies` admit a pod labelled `labels` to `port`.
function admits(policies, labels, port) {
  // Policies add up: one rule of one of them is enough.
  return policies.length === 0 || policies.some((p) => (p.spec.ingress || []).some((rule) => {
    const peers = rule.from || [];
    const peerOk = peers.length === 0 || peers.some((peer) => !peer.namespaceSelector && peer.podSelector && labelsMatch(peer.podSelector, labels));
    const portOk = !rule.ports || rule.ports.some((p) => p.port === port);
    return peerOk && portOk;
  }));
}

function checkTrainingJob(where, o, c, coordinators) {
  const at = `${where} container ${c.name}`;
  const spec = o.spec;
  const pod = spec.template;
  if (spec.completionMode !== "Indexed") problem(where, "is not an Indexed Job");
  if (spec.completions !== spec.parallelism) problem(where, `completions ${spec.completions} != parallelism ${spec.parallelism}: some nodes would wait for others that never start`);
  if (!/(^|\/)cohortrun$/.test((c.command || [])[0] || "")) {
    problem(at, "does not run cohortrun");
    return;
  }
  const f = flags(c.args);
  const nnodes = (f.get("nnodes") || "1").split(":");
  if (Number(nnodes[nnodes.length - 1]) !== spec.completions) {
    problem(at, `--nnodes=${f.get("nnodes")} but the Job has ${spec.completions} completions`);
  }
  if (f.get("node_id") !== "$(JOB_COMPLETION_INDEX)") problem(at, "--node_id is not $(JOB_COMPLETION_INDEX)");
  const env = new Map((c.env || []).map((e) => [e.name, e]));
  const runId = f.get("run_id") || "";
  const jobNameEnv = env.get("JOB_NAME");
  const fromLabel = jobNameEnv && jobNameEnv.valueFrom && jobNameEnv.valueFrom.fieldRef &&
      jobNameEnv.valueFrom.fieldRef.fieldPath === "metadata.labels['job-name']";
  if (runId !== o.metadata.name && !(runId === "$(JOB_NAME)" && fromLabel)) {
    problem(at, `--run_id=${runId} is not the Job's name`);
  }
  if (!((pod.metadata && pod.metadata.labels) || {})["cohort.dev/role"]) {
    problem(where, "pods lack the label cohort.dev/role=training that cohortd's NetworkPolicy admits");
  }
  if (!["Never", "OnFailure"].includes(pod.spec.restartPolicy)) problem(where, "restartPolicy must be Never or OnFailure");
  // Its coordinator: a cohortd Service of the same namespace, on its ports.
  const m = /^([a-z0-9-]+)(?:\.\$\(POD_NAMESPACE\)\.svc|\.([a-z0-9-]+)\.svc)?:(\d+)$/.exec(f.get("coordinator") || "");
  if (!m) {
    problem(at, `--coordinator=${f.get("coordinator")} is not SERVICE.$(POD_NAMESPACE).svc:PORT`);
    return;
  }
  const namespace = m[2] || o.metadata.namespace;
  const target = coordinators.find((k) => k.namespace === namespace && k.services.has(m[1]));
  if (!target) {
    problem(at, `--coordinator: no overlay renders a cohortd Service '${m[1]}' in namespace ${namespace}`);
    return;
  }
  const service = target.services.get(m[1]);
  const servicePort = (n) => (service.spec.ports || []).some((p) => p.port === n);
  if (Number(m[3]) !== target.cfg.grpcPort || !servicePort(target.cfg.grpcPort)) {
    problem(at, `--coordinator port ${m[3]} is not cohortd's gRPC port ${target.cfg.grpcPort} on Service ${m[1]}`);
  }
  const labels = pod.metadata.labels || {};
  const need = [target.cfg.grpcPort];
  const program = afterDashes(c.args);
  const torch = program.some((a) => /python/.test(a));
  if (torch) {
    // PyTorch bootstraps through cohortd's TCPStore listener.
    if (target.cfg.tcpstorePort === null) {
      problem(at, `runs PyTorch, but cohortd (${target.render.name}) serves no TCPStore listener`);
    } else {
      need.push(target.cfg.tcpstorePort);
      const ts = f.get("tcpstore");
      if (ts !== undefined && portOf(ts) !== target.cfg.tcpstorePort) problem(at, `--tcpstore=${ts} is not cohortd's TCPStore port ${target.cfg.tcpstorePort}`);
      if (!servicePort(target.cfg.tcpstorePort)) problem(at, `Service ${m[1]} does not expose the TCPStore port`);
    }
  }
  for (const port of need) {
    if (!admits(target.policies, labels, port)) {
      problem(at, `cohortd's NetworkPolicy (${target.render.name}) does not admit these pods to port ${port}`);
    }
  }
  // Credentials agree with what cohortd asks for.
  if (target.cfg.tls !== env.has("COHORT_TLS_CA")) problem(at, `COHORT_TLS_CA ${env.has("COHORT_TLS_CA") ? "set" : "unset"}, but cohortd (${target.render.name}) ${target.cfg.tls ? "serves" : "does not serve"} TLS`);
  if (target.cfg.mtls !== (env.has("COHORT_TLS_CERT") && env.has("COHORT_TLS_KEY"))) problem(at, `COHORT_TLS_CERT/KEY do not match cohortd's mTLS (${target.render.name})`);
  const token = env.get("COHORT_TOKEN");
  if (target.cfg.auth !== Boolean(token)) problem(at, `COHORT_TOKEN ${token ? "set" : "unset"}, but cohortd (${target.render.name}) ${target.cfg.auth ? "requires" : "takes no"} tokens`);
  if (token) {
    const ref = token.valueFrom && token.valueFrom.secretKeyRef;
    if (!ref) problem(at, "COHORT_TOKEN is not taken from a Secret");
    else if (ref.name !== `${o.metadata.name}-token`) problem(at, `COHORT_TOKEN comes from Secret ${ref.name}, not this job's own ${o.metadata.name}-token`);
  }
}

function checkRender(render, ctx) {
  const byKind = (kind) => render.objects.filter((o) => o.kind === kind);
  const pods = render.objects.filter(podTemplate);
  for (const o of render.objects) {
    const where = `${render.name} ${o.kind} ${o.metadata.name}`;
    if (!o.metadata.namespace) problem(where, "has no namespace (the overlay must set one)");
    if (o.kind === "Service") {
      const backends = pods.filter((w) => serviceSelects(o, w.spec.template.metadata.labels));
      if (backends.length === 0) problem(where, "selects no pods of this overlay");
      for (const p of o.spec.ports || []) {
        const target = p.targetPort === undefined ? p.port : p.targetPort;
        for (const w of backends) {
          if (!w.spec.template.spec.containers.some((c) => containerPort(c, target))) {
            problem(where, `targetPort ${target} is no containerPort of ${w.kind} ${w.metadata.name}`);
          }
        }
      }
    }
    if (o.kind === "PodDisruptionBudget" && !pods.some((w) => labelsMatch(o.spec.selector, w.spec.template.metadata.labels))) {
      problem(where, "selects no pods of this overlay");
    }
    if (o.kind === "StatefulSet") {
      const s = byKind("Service").find((x) => x.metadata.name === o.spec.serviceName);
      if (!s || s.spec.clusterIP !== "None") problem(where, `serviceName ${o.spec.serviceName} is no headless Service of this overlay`);
    }
    const pod = podTemplate(o);
    if (!pod) continue;
    if (!labelsMatch(o.spec.selector, pod.metadata.labels) && o.kind !== "Job") {
      problem(where, "selector does not match its pod template's labels");
    }
    for (const c of pod.spec.containers) checkContainer(where, o, pod, c, ctx);
    for (const v of pod.spec.volumes || []) {
      const source = v.secret || v.configMap;
      if (!source) continue;
      const kind = v.secret ? "Secret" : "ConfigMap";
      const name = v.secret ? v.secret.secretName : v.configMap.name;
      ctx.needKeys(`${where} volume ${v.name}`, kind, name, (source.items || []).map((i) => i.key), source.optional);
    }
  }
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const YAML = require(path.join(args.tools, "node_modules/yaml"));
  const stages = checkDockerfile(args.workspace);
  checkImageComments(args.workspace, stages);
  const readme = fs.readFileSync(path.join(args.workspace, "deploy/k8s/README.md"), "utf8");
  const documented = documentedObjects(readme);

  const renders = [];
  for (const r of args.renders) {
    const objects = [];
    const docs = YAML.parseAllDocuments(fs.readFileSync(r.file, "utf8"));
    for (const doc of docs) {
      if (doc.errors.length) {
        problem(r.name, `YAML: ${doc.errors[0].message}`);
        continue;
      }
      const o = doc.toJS();
      if (o === null) continue;
      const where = `${r.name} ${o.kind || "(no kind)"} ${(o.metadata && o.metadata.name) || "(no name)"}`;
      if (typeof o !== "object" || !o.apiVersion || !o.kind || !o.metadata || !o.metadata.name) {
        problem(where, "is not an object with apiVersion, kind and metadata.name");
        continue;
      }
      const Model = await modelClass(args.tools, o.apiVersion, o.kind);
      if (!Model) {
        problem(where, `unknown kind ${o.apiVersion}/${o.kind}: kubernetes-models has no schema for it`);
        continue;
      }
      try {
        new Model(o).validate();
      } catch (e) {
        problem(where, `schema: ${e.message}`);
        continue;
      }
      for (const field of unknownFields(Model.prototype.validate, o)) {
        problem(where, `unknown field ${field}`);
      }
      objects.push(o);
    }
    if (objects.length === 0) problem(r.name, "renders no objects");
    renders.push({ name: r.name, objects });
  }

  // Per render; Secrets and ConfigMaps must be rendered or documented.
  for (const render of renders) {
    const ctx = {
      stages,
      needKeys(where, kind, name, keys, optional) {
        const rendered = render.objects.find((o) => o.kind === kind && o.metadata.name === name);
        let have;
        if (rendered) have = new Set([...Object.keys(rendered.data || {}), ...Object.keys(rendered.stringData || {})]);
        else if (documented[kind].has(name)) have = documented[kind].get(name);
        else {
          if (!optional) problem(where, `${kind} ${name} is neither generated by the overlay nor created in deploy/k8s/README.md`);
          return;
        }
        for (const k of keys) {
          if (!have.has(k)) problem(where, `${kind} ${name} has no key '${k}' (${rendered ? "as generated" : "as README.md creates it"})`);
        }
      },
    };
    checkRender(render, ctx);
  }

  // cohortd and the jobs that use it, across overlays.
  const coordinators = [];
  for (const render of renders) {
    for (const o of render.objects) {
      if (o.kind !== "StatefulSet" && o.kind !== "Deployment") continue;
      for (const c of o.spec.template.spec.containers) {
        if (path.basename(imageRepo(c.image || "")) !== "cohortd") continue;
        const k = checkCohortd(`${render.name} ${o.kind} ${o.metadata.name}`, o, c, render);
        k.services = new Map(render.objects.filter((s) => s.kind === "Service" && serviceSelects(s, k.pod.metadata.labels)).map((s) => [s.metadata.name, s]));
        coordinators.push(k);
      }
    }
    // etcd that no cohortd names is checked too.
    for (const o of render.objects) {
      if (o.kind !== "StatefulSet") continue;
      for (const c of o.spec.template.spec.containers) {
        if (isEtcdImage(c.image)) checkEtcd(`${render.name} ${o.kind} ${o.metadata.name}`, o, c, render);
      }
    }
  }
  let jobs = 0;
  for (const render of renders) {
    for (const o of render.objects) {
      if (o.kind !== "Job") continue;
      for (const c of o.spec.template.spec.containers) {
        checkTrainingJob(`${render.name} Job ${o.metadata.name}`, o, c, coordinators);
        ++jobs;
      }
    }
  }
  if (coordinators.length === 0) problem("renders", "no overlay renders cohortd");
  if (jobs === 0) problem("renders", "no overlay renders a training Job");

  for (const p of problems) console.log(`FAIL: ${p}`);
  const count = renders.reduce((n, r) => n + r.objects.length, 0);
  console.log(`${problems.length === 0 ? "PASS" : "FAIL"}: ${renders.length} overlays, ${count} objects, ${coordinators.length} cohortd, ${jobs} training jobs; ${problems.length} problems`);
  process.exit(problems.length === 0 ? 0 : 1);
}

main().catch((e) => {
  console.log(`FAIL: validate.js: ${e.stack || e}`);
  process.exit(1);
});
