"""The page's script (plain JavaScript, no library): builds every element from the embedded
data with ``textContent``, and redraws when the address's fragment changes."""

SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const T = D.trajectories;
const MODES = {
  role: "who wrote it", logprob: "rollout logprob", ratio: "learner / sampler ratio",
  advantage: "advantage", version: "staleness", entropy: "entropy"};
const num = v => (v === null || v === undefined) ? null : Number(v);
const fmt = v => v === null ? "-" : (Number.isFinite(v) ? String(+v.toPrecision(4)) : String(v));

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function state() {
  const s = {};
  for (const part of location.hash.slice(1).split("&")) {
    const i = part.indexOf("=");
    if (i > 0) s[decodeURIComponent(part.slice(0, i))] = decodeURIComponent(part.slice(i + 1));
  }
  return s;
}
function go(changes) {
  const s = Object.assign(state(), changes);
  location.hash = Object.keys(s).filter(k => s[k] !== "")
    .map(k => encodeURIComponent(k) + "=" + encodeURIComponent(s[k])).join("&");
}

// a token's colour and hover text under a mode;
// tok = [text, role, lp, learner lp, adv, version, learner entropy, experts]
function colour(tok, mode, step, scale) {
  const [, role, lpRaw, llpRaw, advRaw, version, entRaw] = tok;
  const lp = num(lpRaw), llp = num(llpRaw), adv = num(advRaw), ent = num(entRaw);
  const roleName = {s: "sampled", t: "tool output", p: "template"}[role];
  if (mode === "role") return [null, roleName];
  if (role !== "s") return ["#f4f4f4", roleName + " (not trained)"];
  if (mode === "logprob") {
    if (!Number.isFinite(lp) || lp > 0) return ["#ff4d4d", "rollout logprob " + fmt(lp)];
    return [heat(Math.exp(lp)), "rollout logprob " + fmt(lp) + ", p " + fmt(Math.exp(lp))];
  }
  if (mode === "ratio") {
    if (llp === null) return ["#f4f4f4", "ratio: no learner logprob (untrained)"];
    const r = Math.exp(llp - lp);
    const d = Number.isFinite(r) ? Math.min(Math.abs(Math.log(r)) / 0.5, 1) : 1;
    const c = r >= 1 ? [255, 255 - 180 * d, 255 - 180 * d] : [255 - 180 * d, 255 - 180 * d, 255];
    return [rgb(c), "ratio " + fmt(r) + " (learner " + fmt(llp) + ", sampler " + fmt(lp) + ")"];
  }
  if (mode === "advantage") {
    if (adv === null) return ["#f4f4f4", "advantage: untrained"];
    const d = Number.isFinite(adv) ? Math.min(Math.abs(adv) / scale, 1) : 1;
    const c = adv >= 0 ? [255 - 160 * d, 255, 255 - 160 * d] : [255, 255 - 160 * d, 255 - 160 * d];
    return [rgb(c), "advantage " + fmt(adv)];
  }
  if (mode === "version") {
    const behind = step - 1 - version;  // the step trained the policy of version step - 1
    const c = [[255, 255, 255], [255, 236, 150], [255, 190, 110]][Math.min(behind, 2)]
      || [255, 140, 120];
    return [rgb(c), "weight version " + version + " (" + behind + " behind the policy trained)"];
  }
  if (ent === null) return ["#f4f4f4", "entropy: untrained"];
  // white (certain) to purple, saturating at 3 nats (about 20 equally likely tokens)
  const d = Number.isFinite(ent) ? Math.min(Math.max(ent, 0) / 3, 1) : 1;
  return [rgb([255 - 90 * d, 255 - 170 * d, 255]), "entropy " + fmt(ent) + " nats"];
}
function heat(p) {  // red (unlikely) to green (likely)
  return rgb([255 - 175 * p, 90 + 150 * p, 90]);
}
function rgb(c) { return "rgb(" + c.map(x => Math.round(x)).join(",") + ")"; }
function advScale(t) {
  let m = 1e-6;
  for (const k of t.tokens) {
    const a = num(k[4]);
    if (Number.isFinite(a)) m = Math.max(m, Math.abs(a));
  }
  return m;
}

function tokensView(t, mode) {
  const box = el("div", null, "tokens"), scale = advScale(t);
  let turn = null, k = 0, prev = null;
  for (const tok of t.tokens) {
    if (turn === null || (tok[1] === "s" && prev !== "s")) {
      turn = el("div", null, "turn");
      turn.appendChild(el("div", "turn " + k++, "turn-label"));
      box.appendChild(turn);
    }
    const span = el("span", tok[0], "tok " + tok[1]);
    const [bg, hover] = colour(tok, mode, t.step, scale);
    if (bg) span.style.background = bg;
    span.title = tok[7] ? hover + "; experts " + tok[7] : hover;
    turn.appendChild(span);
    prev = tok[1];
  }
  return box;
}

function filtersView(s) {
  const box = document.getElementById("filters");
  box.replaceChildren();
  const fields = [["step", t => t.step], ["source", t => t.source], ["stop", t => t.stop],
                  ["filter", t => t.filter || "(none)"], ["staleness", t => t.staleness]];
  for (const [name, get] of fields) {
    const label = el("label", name), sel = el("select");
    sel.name = name;
    sel.appendChild(el("option", "all"));
    sel.lastChild.value = "";
    for (const v of [...new Set(T.map(get))].sort()) {
      const o = el("option", v); o.value = String(v); sel.appendChild(o);
    }
    sel.value = s[name] || "";
    sel.onchange = () => go({[name]: sel.value});
    label.appendChild(sel); box.appendChild(label);
  }
  for (const name of ["reward_min", "reward_max"]) {
    const label = el("label", name.replace("_", " ")), input = el("input");
    input.type = "number"; input.step = "any"; input.size = 6; input.value = s[name] || "";
    input.onchange = () => go({[name]: input.value});
    label.appendChild(input); box.appendChild(label);
  }
  return t => fields.every(([name, get]) => !s[name] || String(get(t)) === s[name])
    && !(s.reward_min && !(num(t.reward) >= Number(s.reward_min)))
    && !(s.reward_max && !(num(t.reward) <= Number(s.reward_max)));
}

function listView(s, keep, chosen) {
  const table = document.getElementById("list");
  table.replaceChildren();
  const head = el("tr");
  const names = ["#", "step", "uid", "source", "reward", "stop", "filter", "staleness", "turns",
                 "tool calls", "trained"];
  for (const h of names) head.appendChild(el("th", h));
  table.appendChild(head);
  T.forEach((t, i) => {
    if (!keep(t)) return;
    const row = el("tr", null, "pick" + (i === chosen ? " sel" : ""));
    const values = [i, t.step, t.uid, t.source, fmt(num(t.reward)), t.stop, t.filter,
                    t.staleness, t.turns, t.tool_calls, t.trained ? "yes" : "no"];
    for (const v of values) row.appendChild(el("td", v));
    row.onclick = () => go({t: String(i)});
    table.appendChild(row);
  });
}

function detailView(t, mode) {
  const box = document.getElementById("detail");
  box.replaceChildren();
  const modes = el("div", null, "modes");
  for (const [m, label] of Object.entries(MODES)) {
    const b = el("button", label, m === mode ? "on" : "");
    b.dataset.mode = m;
    b.onclick = () => go({mode: m});
    modes.appendChild(b);
  }
  box.appendChild(modes);
  const legend = el("div", null, "legend");
  for (const [cls, name] of [["s", "sampled (trained)"], ["t", "tool output"], ["p", "template"]])
    legend.appendChild(el("span", name, "tok " + cls + " key"));
  box.appendChild(legend);
  box.appendChild(el("p", "step " + t.step + " | " + t.uid + " | group " + t.group
    + " | reward " + fmt(num(t.reward)) + " | stop " + t.stop
    + (t.filter ? " | filtered by " + t.filter : "") + " | staleness " + t.staleness
    + (t.forked_from ? " | forked from " + t.forked_from : "")));
  const prompt = el("details");
  prompt.appendChild(el("summary", "prompt"));
  prompt.appendChild(el("div", t.prompt, "tokens prompt"));
  box.appendChild(prompt);
  box.appendChild(tokensView(t, mode));
  if (t.error) box.appendChild(el("pre", t.error, "error"));
  box.appendChild(el("h3", "Messages, tool calls and results"));
  for (const b of t.blocks) {
    const block = el("div", null, "block " + b.role);
    block.appendChild(el("div", b.role, "role"));
    if (b.text) block.appendChild(el("pre", b.text));
    if (b.calls) {
      block.appendChild(el("div", "tool calls", "role"));
      block.appendChild(el("pre", b.calls));
    }
    box.appendChild(block);
  }
}

function groupView(t, chosen, mode) {
  const box = document.getElementById("group"), tree = document.getElementById("tree");
  box.replaceChildren(); tree.replaceChildren();
  const members = T.map((u, i) => [u, i]).filter(([u]) => u.step === t.step && u.group === t.group);
  for (const [u, i] of members) {
    const col = el("div", null, "col" + (i === chosen ? " sel" : ""));
    const head = el("div", u.uid + " | reward " + fmt(num(u.reward)) + " | " + u.stop);
    head.style.fontWeight = "bold";
    col.appendChild(head);
    col.appendChild(tokensView(u, mode));
    col.onclick = () => go({t: String(i)});
    box.appendChild(col);
  }
  if (!members.some(([u]) => u.forked_from)) return;
  tree.appendChild(el("h2", "Tree rollout"));
  const uids = new Set(members.map(([u]) => u.uid));
  const branch = parent => {
    const ul = el("ul");
    for (const [u, i] of members) {
      const root = !u.forked_from || !uids.has(u.forked_from);
      if (parent === null ? !root : u.forked_from !== parent) continue;
      const li = el("li"), a = el("a", u.uid + " (reward " + fmt(num(u.reward)) + ")");
      a.href = "#t=" + i;
      li.appendChild(a);
      const sub = branch(u.uid);
      if (sub.childNodes.length) li.appendChild(sub);
      ul.appendChild(li);
    }
    return ul;
  };
  tree.appendChild(branch(null));
}

function draw() {
  const s = state();
  document.getElementById("title").textContent = "jarl view: " + D.run;
  const plots = document.getElementById("plots");
  plots.replaceChildren();
  for (const p of D.plots) {
    const a = el("a", p); a.href = p; plots.appendChild(a); plots.appendChild(el("span", " "));
  }
  const steps = document.getElementById("steps");
  steps.replaceChildren();
  if (D.steps.length) {
    const keys = Object.keys(D.steps[0]), head = el("tr");
    for (const k of keys) head.appendChild(el("th", k));
    steps.appendChild(head);
    for (const st of D.steps) {
      const row = el("tr", null, "pick");
      for (const k of keys) row.appendChild(el("td", fmt(num(st[k]))));
      row.onclick = () => go({step: String(st.step)});
      steps.appendChild(row);
    }
  }
  const keep = filtersView(s);
  let chosen = Number(s.t);
  if (!(chosen >= 0 && chosen < T.length)) chosen = T.findIndex(keep);
  listView(s, keep, chosen);
  if (chosen < 0) return;
  const mode = MODES[s.mode] ? s.mode : "role";
  detailView(T[chosen], mode);
  groupView(T[chosen], chosen, mode);
}
window.addEventListener("hashchange", draw);
draw();
"""
