// The engine view: each loaded model's memory, keep-alive, queue, running batch (row by
// row) and last requests, from GET /admin/events (gateway/admin/state.py documents it).

import { fill, fmtBytes, fmtRate, fmtSeconds, h } from "./dom.js";

const $ = (id) => document.getElementById(id);

export class EngineView {
  update(state) {
    $("engine-summary").textContent =
      `memory budget ${fmtBytes(state.memory_budget_bytes)} · ` +
      (state.keep_alive_seconds > 0 ? `models unload after ${state.keep_alive_seconds} s idle` : "models never unload") +
      (state.prompts_shown ? "" : " · prompt text hidden (no API key and not on loopback)");
    fill($("engine-models"), state.models.length
      ? state.models.map(renderModel)
      : h("p", { class: "empty" }, "No model is loaded; a request loads one."));
  }
}

function renderModel(m) {
  return h("article", { class: "model-card", "data-model": m.id },
    h("h2", {}, m.id, h("span", { class: `badge ${m.state}` }, m.state), keepAlive(m)),
    m.memory ? renderMemory(m.memory) : null,
    m.queue ? h("p", { class: "note" },
      `queue: ${m.queue.waiting} waiting of ${m.queue.capacity} places · batch of up to ${m.max_batch}`) : null,
    h("h3", {}, "Running"),
    renderBatch(m.batch),
    h("h3", {}, "Recent requests"),
    renderRecent(m.recent));
}

function keepAlive(m) {
  let text = "";
  if (m.keep_alive_left_seconds !== null) text = `unloads in ${fmtSeconds(m.keep_alive_left_seconds)}`;
  else if (m.idle_seconds === null && m.state === "loaded") text = "in use";
  return text ? h("span", { class: "note" }, ` ${text}`) : null;
}

// What the model counts against the budget: its weights, and its cache memory split
// between the running batch, the trie's snapshots and what is free.
function renderMemory(mem) {
  const caches = mem.cache_budget_bytes;
  const budget = Math.max(1, mem.weights_bytes + caches);
  const free = Math.max(0, caches - mem.running_kv_bytes - mem.trie_memory_bytes);
  const parts = [
    ["weights", "weights", mem.weights_bytes],
    ["kv", "running KV", mem.running_kv_bytes],
    ["trie", "trie snapshots", mem.trie_memory_bytes],
    ["free", "free", free],
  ];
  const bar = h("div", { class: "bar" }, parts.map(([cls, label, n]) => {
    const seg = h("span", { class: `seg ${cls}`, title: `${label}: ${fmtBytes(n)}` });
    seg.style.width = `${(100 * n) / budget}%`;
    return seg;
  }));
  return h("div", { class: "memory" },
    h("p", {}, `${fmtBytes(budget)}: `,
      parts.map(([cls, label, n]) => h("span", { class: `key ${cls}` }, `${label} ${fmtBytes(n)}`)),
      ` · caches ${fmtBytes(caches)}, of which the trie may hold ${fmtBytes(mem.trie_limit_bytes)} now`,
      ` · disk tier ${mem.disk_budget_bytes ? `${fmtBytes(mem.disk_bytes)} of ${fmtBytes(mem.disk_budget_bytes)}` : "off"}`),
    bar);
}

function renderBatch(rows) {
  if (!rows.length) return h("p", { class: "empty" }, "Nothing running.");
  return h("table", { class: "rows batch" },
    h("thead", {}, h("tr", {}, ["#", "phase", "prompt", "cached", "progress", "generated", "speed", "drafts kept", "TTFT", "age"]
      .map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.map((r) => {
      const tr = h("tr", { class: `row ${r.phase}`, "data-phase": r.phase, "data-id": r.id },
        h("td", {}, r.id), h("td", {}, r.phase), h("td", {}, r.prompt_tokens),
        h("td", {}, r.cached_tokens ?? "–"), h("td", {}, progress(r)),
        h("td", {}, `${r.generated_tokens} / ${r.max_tokens}`), h("td", {}, fmtRate(r.tokens_per_second)),
        h("td", {}, drafts(r)), h("td", {}, fmtSeconds(r.ttft_seconds)), h("td", {}, fmtSeconds(r.age_seconds)));
      return tr;
    })));
}

// speculative decoding: drafted tokens the model kept, of those checked
function drafts(r) {
  return r.drafted_tokens ? `${r.accepted_tokens} / ${r.drafted_tokens}` : "–";
}

function progress(r) {
  const bar = h("span", { class: "progress", title: `${r.prefilled_tokens} of ${r.prompt_tokens} prompt tokens in` },
    h("span", { class: "done" }));
  bar.firstChild.style.width = `${Math.round(100 * r.progress)}%`;
  return bar;
}

function renderRecent(recent) {
  if (!recent.length) return h("p", { class: "empty" }, "None yet.");
  return h("table", { class: "rows recent" },
    h("thead", {}, h("tr", {}, ["#", "prompt", "cached", "generated", "TTFT", "speed", "drafts kept", "end", "cache", "prompt text"]
      .map((c) => h("th", {}, c)))),
    h("tbody", {}, [...recent].reverse().map((r) =>
      h("tr", { "data-id": r.id },
        h("td", {}, r.id), h("td", {}, r.prompt_tokens), h("td", {}, r.cached_tokens),
        h("td", {}, r.completion_tokens), h("td", {}, fmtSeconds(r.ttft_seconds)),
        h("td", {}, fmtRate(r.tokens_per_second)), h("td", {}, drafts(r)),
        h("td", { title: r.error ?? "" }, r.finish_reason),
        h("td", { title: r.cache?.detail ?? "" }, r.cache ? r.cache.reason : "–"),
        h("td", { class: "text" }, r.prompt ?? "")))));
}
