// Markdown as DOM, safely: the text is split into blocks and inline spans by hand and
// every piece is added as a text node; no HTML in the text is ever interpreted, and
// links are kept only for http(s) URLs. Covers what chat models write: paragraphs,
// headings, fenced code, lists, quotes, tables, rules, `code`, **bold**, *italics*, links.
// An unterminated code fence (a reply still streaming) runs to the end.

import { h } from "./dom.js";

const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;
const INLINE =
  /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=[^\s*])([^*]*[^\s*])\*|\b_(?=\S)([^_]*\S)_\b|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1;
      out.append(codeBlock(body.join("\n"), fence[2]));
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      out.append(h(`h${Math.min(6, heading[1].length + 2)}`, {}, inline(heading[2])));
      i += 1;
    } else if (RULE.test(line)) {
      out.append(h("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].match(QUOTE)[1]);
      out.append(h("blockquote", {}, renderMarkdown(body.join("\n"))));
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      i = table(lines, i, out);
    } else {
      const body = [];
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) body.push(lines[i++]);
      if (!body.length) body.push(lines[i++]);
      out.append(h("p", {}, inline(body.join("\n"))));
    }
  }
  return out;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function codeBlock(code, lang) {
  const copy = h("button", { type: "button", class: "copy", title: "Copy the code" }, "Copy");
  copy.addEventListener("click", () => navigator.clipboard?.writeText(code));
  return h("div", { class: "code" },
    h("div", { class: "code-head" }, h("span", {}, lang || "code"), copy),
    h("pre", {}, h("code", { class: lang ? `lang-${lang}` : "" }, code)));
}

function list(lines, i, out) {
  const first = lines[i].match(ITEM);
  const ordered = /\d/.test(first[2]);
  const el = h(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) el.start = parseInt(first[2], 10);
  let item = null;
  while (i < lines.length) {
    const m = lines[i].match(ITEM);
    if (m && /\d/.test(m[2]) === ordered) {
      item = [m[3]];
      el.append(h("li"));
    } else if (item && lines[i].trim() && /^\s+/.test(lines[i])) {
      item.push(lines[i].trim()); // a continuation line
    } else {
      break;
    }
    el.lastChild.replaceChildren(inline(item.join("\n")));
    i += 1;
  }
  out.append(el);
  return i;
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function table(lines, i, out) {
  const head = h("tr", {}, cells(lines[i]).map((c) => h("th", {}, inline(c))));
  const body = h("tbody");
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
    body.append(h("tr", {}, cells(lines[i]).map((c) => h("td", {}, inline(c)))));
    i += 1;
  }
  out.append(h("div", { class: "table" }, h("table", {}, h("thead", {}, head), body)));
  return i;
}

// Inline spans as a list of nodes.
export function inline(text) {
  const nodes = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) nodes.push(text.slice(last, m.index));
    if (m[1]) nodes.push(h("code", {}, m[2]));
    else if (m[3] || m[4]) nodes.push(h("strong", {}, inline(m[3] || m[4])));
    else if (m[5] || m[6]) nodes.push(h("em", {}, inline(m[5] || m[6])));
    else nodes.push(link(m[7], m[8], m[0]));
    last = m.index + m[0].length;
  }
  if (last < text.length) nodes.push(text.slice(last));
  return nodes;
}

function link(label, url, whole) {
  if (!/^https?:\/\//i.test(url)) return whole;
  const a = h("a", { target: "_blank", rel: "noopener noreferrer" }, inline(label));
  a.setAttribute("href", url);
  return a;
}
