//! `cachalot explain --html` in a real headless browser: the page's own script runs (Chromium's
//! `--dump-dom` after the script has run), adds the groups' bytes to the `live_bytes` of the
//! JSON report, draws the timeline, and a row selected through `#group=N` (the row's click
//! handler, as a click runs it) shows that group's frames.
//!
//! The browser is `$CACHALOT_CHROMIUM`, else `chromium`, `chromium-browser`, `google-chrome` or
//! `google-chrome-stable` on the PATH. Without one the test says so and passes, unless
//! `CACHALOT_REQUIRE_BROWSER=1` (`.ci/run` sets it, after installing Debian's `chromium`).

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::fixtures_root;

fn browser() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CACHALOT_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in [
            "chromium",
            "chromium-browser",
            "google-chrome",
            "google-chrome-stable",
        ] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

fn required() -> bool {
    std::env::var("CACHALOT_REQUIRE_BROWSER").is_ok_and(|v| v == "1")
}

/// The page's DOM after its script ran, opened at `fragment`.
fn dump_dom(browser: &Path, page: &Path, fragment: &str) -> String {
    let url = format!(
        "file://{}{fragment}",
        std::fs::canonicalize(page).unwrap().display()
    );
    let profile = tempdir("profile");
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            // Nothing may be fetched: every host resolves to nothing.
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .expect("the browser runs");
    assert!(
        out.status.success(),
        "{} failed: {}",
        browser.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&profile);
    String::from_utf8(out.stdout).unwrap()
}

fn tempdir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "cachalot-explain-html-{what}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The text of the element with `id` (the first `<… id="ID" …>TEXT<`).
fn text_of<'a>(dom: &'a str, id: &str) -> Option<&'a str> {
    let at = dom.find(&format!("id=\"{id}\""))?;
    let open = dom[at..].find('>')? + at + 1;
    let close = dom[open..].find('<')? + open;
    Some(&dom[open..close])
}

/// The value of attribute `attr` of the element with `id`.
fn attr_of<'a>(dom: &'a str, id: &str, attr: &str) -> Option<&'a str> {
    let at = dom.find(&format!("id=\"{id}\""))?;
    let end = dom[at..].find('>')? + at;
    let tag_start = dom[..at].rfind('<')?;
    let tag = &dom[tag_start..end];
    let key = format!("{attr}=\"");
    let v = tag.find(&key)? + key.len();
    let e = tag[v..].find('"')? + v;
    Some(&tag[v..e])
}

#[test]
fn the_page_renders_in_a_headless_browser_adds_up_and_its_rows_open_their_frames() {
    let Some(browser) = browser() else {
        assert!(
            !required(),
            "CACHALOT_REQUIRE_BROWSER=1 but no chromium was found (apt-get install chromium)"
        );
        eprintln!("skipped: no chromium on the PATH (set CACHALOT_REQUIRE_BROWSER=1 to fail)");
        return;
    };
    let dir = tempdir("pages");
    for (fixture, group) in [
        ("user/unet_wrapped.pickle.gz", 1usize),
        ("user/gpt2_train_frames.pickle.gz", 0),
        ("expandable/resnet50_warm_expandable.pickle.gz", 2),
    ] {
        let page = dir.join(format!("{}.html", fixture.replace('/', "_")));
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(["explain", "--at", "peak-allocated", "--json", "--html"])
            .arg(&page)
            .arg(fixtures_root().join(fixture))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let live = report["live_bytes"].as_u64().unwrap();
        let groups = report["groups"].as_array().unwrap();
        assert!(groups.len() > group, "{fixture}");

        let html = std::fs::read_to_string(&page).unwrap();
        for external in ["src=", "href=", "<link", "@import", "url("] {
            assert!(
                !html.contains(external),
                "{fixture}: {external} in the page"
            );
        }

        let dom = dump_dom(&browser, &page, &format!("#group={group}"));
        // The script ran and its total is the report's.
        assert_eq!(
            text_of(&dom, "computed-total"),
            Some(live.to_string().as_str()),
            "{fixture}"
        );
        assert_eq!(text_of(&dom, "check"), Some("ok"), "{fixture}");
        // One table row per group, the timeline drawn, the moment marked.
        assert_eq!(
            dom.matches("<tr data-group=").count(),
            groups.len(),
            "{fixture}: rows"
        );
        assert_eq!(dom.matches("<polyline").count(), 3, "{fixture}: timeline");
        assert!(dom.contains("id=\"moment\""), "{fixture}");
        // The row asked for was clicked open: its group, its bytes, its Python frames.
        assert_eq!(
            attr_of(&dom, "detail", "data-group"),
            Some(group.to_string().as_str()),
            "{fixture}"
        );
        assert_eq!(
            attr_of(&dom, "detail-bytes", "data-bytes"),
            Some(
                groups[group]["bytes"]
                    .as_u64()
                    .unwrap()
                    .to_string()
                    .as_str()
            ),
            "{fixture}"
        );
        let python_frames = groups[group]["frames"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f.as_str().unwrap().contains(".py:"))
            .count();
        if python_frames > 0 {
            assert_eq!(
                dom.matches("<li class=\"user\">").count()
                    + dom.matches("<li class=\"lib\">").count(),
                python_frames,
                "{fixture}: the group's Python frames listed"
            );
        }
        assert!(
            dom.contains("class=\"selected\""),
            "{fixture}: the row is marked"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
