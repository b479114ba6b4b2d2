// The prefix-trie view: the trie as an icicle of shared prefixes (each block a run of
// tokens stored once, its continuations below it, widths by tokens), with what each block
// holds (memory, disk, pins, the live path, eviction's next pick) and the recent requests:
// click one to see the path it took and the part it reused.

import { fill, fmtBytes, h } from "./dom.js";

const $ = (id) => document.getElementById(id);

export class TrieView {
  constructor() {
    this.state = null;
    this.request = null; // the selected request's id
    this.node = null; // the selected node, as "start-end" (ids change between states)
    $("trie-model").addEventListener("change", () => this.render());
  }

  update(state) {
    this.state = state;
    const models = state.models.filter((m) => m.trie);
    const chosen = $("trie-model").value;
    fill($("trie-model"), models.map((m) => h("option", { value: m.id, selected: m.id === chosen }, m.id)));
    this.render();
  }

  get model() {
    return this.state?.models.find((m) => m.trie && m.id === $("trie-model").value);
  }

  render() {
    const m = this.model;
    if (!m) {
      fill($("trie-chart"), h("p", { class: "empty" }, "No loaded model has a prefix cache."));
      fill($("trie-requests"));
      fill($("trie-detail"));
      $("trie-stats").textContent = "";
      return;
    }
    const s = m.trie.stats;
    $("trie-stats").textContent =
      `${m.trie.nodes_total - 1} nodes · ${fmtBytes(s.paged_bytes)} in memory of ${fmtBytes(s.limit_bytes)}` +
      (s.disk_bytes !== undefined ? ` · ${fmtBytes(s.disk_bytes)} on disk` : "") +
      ` · ${s.hits} of ${s.requests} requests reused a prefix (${s.reused_tokens} of ${s.prompt_tokens} prompt tokens)` +
      ` · ${s.evictions} evictions`;
    const nodes = m.trie.nodes;
    const kids = nodes.map(() => []);
    for (const n of nodes) if (n.parent !== null) kids[n.parent].push(n);
    const weight = nodes.map(() => 0);
    for (let i = nodes.length - 1; i >= 0; i -= 1) {
      weight[i] += nodes[i].tokens;
      if (nodes[i].parent !== null) weight[nodes[i].parent] += weight[i];
    }
    const block = (n) => {
      const el = h("div", { class: "ice" });
      el.style.flexGrow = String(Math.max(1, weight[n.id]));
      el.append(this.label(n), h("div", { class: "ice-kids" }, kids[n.id].map(block)));
      return el;
    };
    fill($("trie-chart"), kids[0].length
      ? h("div", { class: "ice-kids ice-root" }, kids[0].map(block))
      : h("p", { class: "empty" }, "The trie is empty: no prompt has been cached yet."));
    this.renderRequests(m);
    this.renderDetail(nodes.find((n) => key(n) === this.node));
  }

  label(n) {
    const classes = ["ice-label"];
    if (n.live) classes.push("live");
    if (n.memory_bytes) classes.push("memory");
    if (n.disk_layers) classes.push("disk");
    if (n.pinned) classes.push("pinned");
    if (n.next_eviction) classes.push("evict");
    if (this.request !== null && n.requests.includes(this.request)) classes.push("path");
    if (this.request !== null && n.reused_by.includes(this.request)) classes.push("reused");
    if (key(n) === this.node) classes.push("selected");
    const el = h("button", {
      type: "button",
      class: classes.join(" "),
      title: `tokens ${n.start}–${n.end}; requests ${n.requests.join(", ") || "none recent"}`,
      "data-requests": n.requests.join(" "),
      "data-reused-by": n.reused_by.join(" "),
      "data-tokens": n.tokens,
    }, h("b", {}, `${n.tokens} t`), n.requests.length ? h("span", { class: "count" }, ` ×${n.requests.length}`) : null,
    n.text !== undefined ? h("span", { class: "snippet" }, ` ${n.text}`) : null);
    el.addEventListener("click", () => {
      this.node = key(n) === this.node ? null : key(n);
      this.render();
    });
    return el;
  }

  renderRequests(m) {
    fill($("trie-requests"), m.recent.length ? [...m.recent].reverse().map((r) => {
      const chosen = r.id === this.request;
      const el = h("li", {}, h("button", {
        type: "button", class: chosen ? "request selected" : "request", "data-id": r.id,
        onclick: () => {
          this.request = chosen ? null : r.id;
          this.render();
        },
      }, h("b", {}, `#${r.id}`), ` prompt ${r.prompt_tokens} · cached ${r.cached_tokens}`,
      r.cache ? ` · ${r.cache.reason}` : ""));
      if (chosen) {
        el.append(h("p", { class: "note" }, r.cache ? r.cache.detail : "no cache report"),
          r.prompt ? h("p", { class: "text" }, r.prompt) : null);
      }
      return el;
    }) : h("li", { class: "empty" }, "None yet."));
  }

  renderDetail(n) {
    if (!n) {
      fill($("trie-detail"), h("p", { class: "note" }, "Click a block for its details."));
      return;
    }
    const rows = [
      ["tokens", `${n.tokens} (${n.start}–${n.end})`],
      ["in memory", fmtBytes(n.memory_bytes)],
      ["layers with a snapshot", `${n.layers} (${n.disk_layers} on disk)`],
      ["live path", n.live ? "yes" : "no"],
      ["pinned", n.pinned ? "yes" : "no"],
      ["evicted before", n.evicted ? "yes" : "no"],
      ["evicted next", n.next_eviction ? "yes" : "no"],
      ["requests through it", n.requests.join(", ") || "none recent"],
      ["reused by", n.reused_by.join(", ") || "none recent"],
    ];
    fill($("trie-detail"), h("dl", {}, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
      n.text !== undefined ? h("pre", { class: "text" }, n.text) : null);
  }
}

function key(n) {
  return `${n.start}-${n.end}`;
}
