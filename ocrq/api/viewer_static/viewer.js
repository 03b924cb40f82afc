// ocrq's result viewer: a job's (or a document's pages') lines drawn as boxes over the image,
// the text beside it. Everything it shows comes from the api's own authenticated routes
// (GET /jobs/{id}, GET /documents/{id}, GET /jobs/{id}/image) with the bearer token, which
// the page takes from its address (#token=..., never sent to the server, removed at once) or
// asks for, and keeps in this tab's sessionStorage only.
//
// OCR output is untrusted: text is only ever set through textContent and attributes through
// setAttribute, never parsed as HTML; the page's Content-Security-Policy allows no inline script.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const KEY = "ocrq-token";
const path = location.pathname;
const base = path.slice(0, path.lastIndexOf("/view/"));
const $ = (id) => document.getElementById(id);

function takeToken() {
  const found = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (found) {
    sessionStorage.setItem(KEY, decodeURIComponent(found[1]));
    history.replaceState(null, "", path + location.search); // out of the address bar and history
  }
  return sessionStorage.getItem(KEY) || "";
}

class Unauthorized extends Error {}

async function api(route) {
  const token = takeToken();
  const response = await fetch(base + route, {
    headers: token ? { Authorization: "Bearer " + token } : {},
    cache: "no-store",
  });
  if (response.status === 401) throw new Unauthorized("the api wants a token");
  return response;
}

async function json(route) {
  const response = await api(route);
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(typeof body.detail === "string" ? body.detail : response.statusText);
  }
  return response.json();
}

function el(tag, attrs = {}, text = null) {
  const node = tag.startsWith("svg:")
    ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== null) node.textContent = String(text);
  return node;
}

function notice(message) {
  const box = $("notice");
  box.hidden = false;
  box.textContent = message;
}

function pair(rect, item) {
  const on = (hot) => () => {
    rect.classList.toggle("hot", hot);
    item.classList.toggle("hot", hot);
  };
  for (const node of [rect, item]) {
    node.addEventListener("mouseenter", on(true));
    node.addEventListener("mouseleave", on(false));
  }
}

// One page: `page` has job_id, status, width, height, lines, error; `heading` names it.
function drawPage(page, heading) {
  const section = el("section", { class: "page", "data-job": page.job_id });
  const width = Number(page.width) || 0;
  const height = Number(page.height) || 0;
  const side = el("div", { class: "side" });
  side.append(el("h2", {}, heading));
  const meta = [
    page.status, width && height ? `${width}×${height} px` : null, page.file_name, page.path,
  ]
    .filter(Boolean).join(" · ");
  side.append(el("div", { class: "meta" }, meta));
  if (page.error) side.append(el("div", { class: "error" }, page.error));
  const list = el("ol", { class: "lines" });
  side.append(list);
  const lines = Array.isArray(page.lines) ? page.lines : [];
  let svg = null;
  if (width > 0 && height > 0) {
    const sheet = el("div", { class: "sheet" });
    svg = el("svg:svg", {
      viewBox: `0 0 ${width} ${height}`,
      "data-width": width,
      "data-height": height,
      preserveAspectRatio: "xMinYMin meet",
    });
    svg.append(el("svg:rect", { class: "blank", x: 0, y: 0, width, height }));
    sheet.append(svg);
    section.append(sheet);
    loadImage(page.job_id, sheet, svg, width, height);
  }
  section.append(side);
  lines.forEach((line, i) => {
    const item = el("li", { "data-line": i }, line.text ?? "");
    if (line.label) item.append(el("span", { class: "label" }, line.label));
    if (typeof line.score === "number") {
      item.append(el("span", { class: "score" }, line.score.toFixed(2)));
    }
    list.append(item);
    const box = Array.isArray(line.box) && line.box.length === 4 ? line.box.map(Number) : null;
    if (svg && box && box.every(Number.isFinite)) {
      const [x1, y1, x2, y2] = box;
      const rect = el("svg:rect", {
        class: "box",
        "data-line": i,
        x: Math.min(x1, x2),
        y: Math.min(y1, y2),
        width: Math.abs(x2 - x1),
        height: Math.abs(y2 - y1),
      });
      rect.append(el("svg:title", {}, line.text ?? ""));
      svg.append(rect);
      pair(rect, item);
    }
  });
  $("pages").append(section);
}

// Why a page shows its boxes on a blank sheet, said on the page itself, above the sheet (it
// was only a tooltip over the blank: a URL or inline job looked like a broken page).
function noImage(sheet, svg, reason) {
  svg.setAttribute("data-image", "none");
  sheet.prepend(el("p", { class: "no-image" }, "No image to show: " + reason));
}

async function loadImage(jobId, sheet, svg, width, height) {
  try {
    const response = await api(`/jobs/${encodeURIComponent(jobId)}/image`);
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      const detail = typeof body.detail === "string" ? body.detail : response.statusText;
      const reason = detail.replace(/^no image to show: /, "");
      noImage(sheet, svg, `${reason} (the boxes are drawn on a blank page of the image's size)`);
      return;
    }
    const url = URL.createObjectURL(await response.blob());
    const image = el("svg:image", {
      class: "scan", href: url, x: 0, y: 0, width, height, preserveAspectRatio: "none",
    });
    image.addEventListener("load", () => svg.setAttribute("data-image", "loaded"), { once: true });
    svg.querySelector("rect.blank").after(image); // under the boxes
  } catch (error) {
    noImage(sheet, svg, error.message || "the image could not be loaded");
  }
}

async function showDocument(id) {
  const doc = await json(`/documents/${encodeURIComponent(id)}`);
  const pages = Array.isArray(doc.page_results) ? doc.page_results : [];
  const name = doc.file_name ? ` · ${doc.file_name}` : "";
  $("title").textContent = `document ${id}${name} · ${doc.status} · ${doc.pages ?? "?"} page(s)`;
  if (doc.error) notice(doc.error);
  for (const page of pages) drawPage(page, `page ${page.page}`);
}

async function showJob(id) {
  const row = await json(`/jobs/${encodeURIComponent(id)}`);
  if (row.document_id === row.job_id && row.page == null) return showDocument(id);
  $("title").textContent = `job ${id}${row.file_name ? " · " + row.file_name : ""} · ${row.status}`;
  drawPage(row, row.page ? `page ${row.page} of document ${row.document_id}` : "image");
}

function askForToken() {
  const form = $("login");
  form.hidden = false;
  $("title").textContent = "";
  notice("Enter the api's bearer token (OCRQ_API_TOKEN) to see this result.");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("token").value);
    location.reload();
  });
}

async function main() {
  const rest = decodeURIComponent(path.slice(base.length + "/view/".length));
  const [kind, id] = rest.startsWith("documents/") ? ["document", rest.slice(10)] : ["job", rest];
  if (!id || id.includes("/")) {
    // Not a viewer address (the server answered 404 with this page): the token still leaves
    // the address bar, as on every other page.
    takeToken();
    $("title").textContent = "";
    notice("No such page: the viewer is at /view/JOB_ID or /view/documents/DOCUMENT_ID.");
    document.body.setAttribute("data-ready", "error");
    return;
  }
  try {
    await (kind === "document" ? showDocument(id) : showJob(id));
    document.body.setAttribute("data-ready", "true");
  } catch (error) {
    if (error instanceof Unauthorized) askForToken();
    else notice(`${kind} ${id}: ${error.message}`);
    document.body.setAttribute("data-ready", "error");
  }
}

main();
