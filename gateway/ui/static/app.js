// The page's entry: asks for the API key when the server has one (kept in this tab's
// session storage; nothing is shown without it), then starts the chat, engine and trie
// views and the one event stream the last two share. The view follows the URL's #hash.

import { auth, getJSON, HttpError, watchState } from "./api.js";
import { ChatView } from "./chat.js";
import { EngineView } from "./engine.js";
import { TrieView } from "./trie.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["chat", "engine", "trie"];
let started = false;

function askKey(message) {
  $("app").hidden = true;
  $("nav").hidden = true;
  $("login").hidden = false;
  $("login-msg").textContent = message;
  $("key").focus();
}

async function open() {
  if (auth.required && !auth.key) {
    askKey("");
    return;
  }
  let models;
  try {
    models = await getJSON("/v1/models");
  } catch (err) {
    if (err instanceof HttpError && err.status === 401) {
      auth.clear();
      askKey("That key was refused.");
      return;
    }
    $("live-status").textContent = `The server did not answer: ${err.message}`;
    return;
  }
  $("login").hidden = true;
  $("app").hidden = false;
  $("nav").hidden = false;
  if (started) return;
  started = true;
  new ChatView(models);
  const engine = new EngineView();
  const trie = new TrieView();
  watchState(
    (state) => {
      engine.update(state);
      trie.update(state);
    },
    (status) => ($("live-status").textContent = `engine: ${status}`),
    () => {
      auth.clear();
      askKey("The key was refused.");
    },
  );
  showView();
}

function showView() {
  const name = VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
  for (const view of VIEWS) $(`view-${view}`).hidden = view !== name;
  for (const link of $("nav").querySelectorAll("a")) {
    link.classList.toggle("current", link.dataset.view === name);
  }
}

$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  auth.set($("key").value.trim());
  $("key").value = "";
  open();
});
window.addEventListener("hashchange", showView);
open();
