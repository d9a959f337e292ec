//! `/live` on the `--http` server: the live view ([`crate::live`]) as JSON, as
//! server-sent events, and as a page.
//!
//! | path | answer |
//! |---|---|
//! | `/live` | the live page (one self-contained HTML file) |
//! | `/live/runs` | 200, [`RunList`](crate::live::snapshot::RunList) as JSON |
//! | `/live/runs/<run>?steps=N` | 200, [`RunSnapshot`] with the last `N` steps per rank (default [`DEFAULT_ANSWER_STEPS`]); 404 naming the runs held |
//! | `/live/runs/<run>/events?steps=N` | `text/event-stream`: an `event: snapshot` with that JSON every [`EVENT_INTERVAL`], an `event: gone` if the view forgets the run |
//!
//! These show training data, so with a token configured (`--token-file`) each
//! request must carry it: `Authorization: Bearer <token>`, or `?token=<token>`
//! (a browser's `EventSource` cannot set headers). Without one they answer 401.
//! The `--http` server itself has no TLS: bind it to loopback (the command's
//! example does) or put it behind a TLS proxy; docs/live.md says how.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode, header};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::http::{Body, text};
use crate::live::snapshot::RunSnapshot;
use crate::live::{Findings, LiveView};

/// Steps per rank in an answer unless `?steps=` says otherwise: the straggler
/// test's 20 steps with room, and about 8 MiB of JSON at 1,024 ranks.
pub const DEFAULT_ANSWER_STEPS: usize = 32;
/// How often an event stream sends the run.
pub const EVENT_INTERVAL: Duration = Duration::from_secs(1);

/// The page, with no script or style from elsewhere.
const PAGE: &str = include_str!("live.html");

/// What `/live` answers from.
#[derive(Debug, Clone)]
pub struct LiveEndpoints {
    view: Arc<LiveView>,
    /// The collector's token, when it has one.
    token: Option<String>,
    /// The live diagnoses, added to every answer about a run.
    findings: Option<Findings>,
}

impl LiveEndpoints {
    pub fn new(view: Arc<LiveView>, token: Option<String>) -> LiveEndpoints {
        LiveEndpoints {
            view,
            token: token.map(|t| t.trim().to_string()),
            findings: None,
        }
    }

    /// Adds the live diagnoses to every answer about a run.
    pub fn with_findings(mut self, findings: Option<Findings>) -> LiveEndpoints {
        self.findings = findings;
        self
    }

    /// The run with its findings and the last `steps` steps per rank; `None`
    /// when the view holds no such run.
    ///
    /// The findings read every step the view keeps, whatever `steps` asks for:
    /// the ranks' newest steps differ by up to a batch each (500 ms of steps),
    /// and the diagnoses compare only the steps every rank has, so on a viewer's
    /// short window (32 steps of each rank) they saw too few to fire.
    fn snapshot(&self, run_id: &str, steps: usize) -> Option<RunSnapshot> {
        let mut snapshot = self.view.run(run_id, steps.max(self.view.steps_kept()))?;
        if let Some(findings) = &self.findings {
            snapshot.findings = (findings.0)(&snapshot);
        }
        snapshot.keep_last_steps(steps);
        Some(snapshot)
    }

    /// The answer to a request for a path under `/live`.
    pub fn respond<B>(&self, request: &Request<B>) -> Response<Body> {
        let path = request.uri().path();
        let query = request.uri().query().unwrap_or("");
        if path == "/live" || path == "/live/" {
            // The page holds no data: it asks for it with the token it was given.
            let mut response = Response::new(full(PAGE));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("text/html; charset=utf-8"),
            );
            return response;
        }
        if let Err(why) = self.authorize(request, query) {
            return text(StatusCode::UNAUTHORIZED, why);
        }
        let steps = match param(query, "steps") {
            None => DEFAULT_ANSWER_STEPS,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return text(
                        StatusCode::BAD_REQUEST,
                        &format!(
                            "steps={v} is not a count of steps: give a whole number from 1 up \
                             (the view keeps {} per rank)\n",
                            self.view.steps_kept()
                        ),
                    );
                }
            },
        };
        let rest = path.strip_prefix("/live/runs").unwrap_or("");
        if rest.is_empty() || rest == "/" {
            return json(&self.view.runs());
        }
        let rest = rest.trim_start_matches('/');
        let (run_id, events) = match rest.strip_suffix("/events") {
            Some(run) => (run, true),
            None => (rest, false),
        };
        let Some(snapshot) = self.snapshot(run_id, steps) else {
            return self.unknown_run(run_id);
        };
        if !events {
            return json(&snapshot);
        }
        event_stream(self.clone(), run_id.to_string(), steps, snapshot)
    }

    fn authorize<B>(&self, request: &Request<B>, query: &str) -> Result<(), &'static str> {
        let Some(token) = &self.token else {
            return Ok(());
        };
        let header = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let given = header.map(str::to_string).or_else(|| param(query, "token"));
        match given {
            Some(given) if constant_time_eq(given.as_bytes(), token.as_bytes()) => Ok(()),
            _ => Err(
                "missing or wrong token: the live view shows training data; send the contents \
                 of the collector's --token-file as `Authorization: Bearer <token>` (rankscope \
                 top --token-file) or open /live#token=<token>\n",
            ),
        }
    }

    fn unknown_run(&self, run_id: &str) -> Response<Body> {
        let runs = self.view.runs().runs;
        let held = if runs.is_empty() {
            "it holds no run yet: has a rank sent to this collector?".to_string()
        } else {
            let names: Vec<&str> = runs.iter().map(|r| r.run_id.as_str()).collect();
            format!("it holds {}", names.join(", "))
        };
        text(
            StatusCode::NOT_FOUND,
            &format!("no run {run_id:?} in the live view: {held}\n"),
        )
    }
}

/// Compares without an early exit, so timing does not leak the token's prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The value of `name` in a query string, percent-decoded.
fn param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (key == name).then(|| percent_decode(value))
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed_unsync()
}

fn json<T: serde::Serialize>(value: &T) -> Response<Body> {
    match serde_json::to_vec(value) {
        Ok(bytes) => {
            let mut response = Response::new(full(bytes));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(error) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("cannot encode the live view: {error}\n"),
        ),
    }
}

/// One server-sent event.
fn event(name: &str, data: &[u8]) -> Frame<Bytes> {
    let mut out = Vec::with_capacity(data.len() + name.len() + 16);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
    Frame::data(Bytes::from(out))
}

/// Sends `first`, then the run again every [`EVENT_INTERVAL`], until the client
/// goes away (or the server stops, which drops the connection).
fn event_stream(
    live: LiveEndpoints,
    run_id: String,
    steps: usize,
    first: RunSnapshot,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(2);
    tokio::spawn(async move {
        let mut snapshot = Some(first);
        loop {
            let frame = match snapshot.take() {
                Some(s) => match serde_json::to_vec(&s) {
                    Ok(data) => event("snapshot", &data),
                    Err(_) => return,
                },
                None => {
                    let _ = tx.send(Ok(event("gone", run_id.as_bytes()))).await;
                    return;
                }
            };
            if tx.send(Ok(frame)).await.is_err() {
                return;
            }
            tokio::time::sleep(EVENT_INTERVAL).await;
            snapshot = live.snapshot(&run_id, steps);
        }
    });
    let mut response = Response::new(StreamBody::new(ReceiverStream::new(rx)).boxed_unsync());
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(path: &str, auth: Option<&str>) -> Request<()> {
        let mut b = Request::get(path);
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn answers_only_with_the_token_when_one_is_set() {
        let view = Arc::new(LiveView::new(4));
        let open = LiveEndpoints::new(view.clone(), None);
        assert_eq!(open.respond(&get("/live/runs", None)).status(), 200);
        let locked = LiveEndpoints::new(view, Some("s3cret\n".into()));
        for (path, auth) in [
            ("/live/runs", None),
            ("/live/runs", Some("Bearer s3cre")),
            ("/live/runs", Some("s3cret")),
            ("/live/runs?token=s3cret2", None),
        ] {
            assert_eq!(locked.respond(&get(path, auth)).status(), 401, "{path}");
        }
        assert_eq!(
            locked
                .respond(&get("/live/runs", Some("Bearer s3cret")))
                .status(),
            200
        );
        assert_eq!(
            locked
                .respond(&get("/live/runs?token=s3cret", None))
                .status(),
            200
        );
        // The page carries no data: it loads without the token.
        assert_eq!(locked.respond(&get("/live", None)).status(), 200);
    }

    #[test]
    fn an_unknown_run_or_a_bad_count_is_named() {
        let view = Arc::new(LiveView::new(4));
        let live = LiveEndpoints::new(view, None);
        let r = live.respond(&get("/live/runs/nope", None));
        assert_eq!(r.status(), 404);
        let r = live.respond(&get("/live/runs/nope?steps=x", None));
        assert_eq!(r.status(), 400);
    }

    #[test]
    fn findings_read_every_step_kept_whatever_the_answer_holds() {
        use rankscope_proto::Table;
        use rankscope_proto::v1::{Batch, StepRow};
        let view = Arc::new(LiveView::new(64));
        // Three ranks whose newest steps differ by a batch, as they arrive.
        for (rank, last) in [(0u32, 137u64), (1, 126), (2, 117)] {
            let batch = Batch {
                seq: 1,
                steps: (last - 99..=last)
                    .map(|step| StepRow {
                        step,
                        step_ms: 20.0,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            };
            let bytes = prost::Message::encode_to_vec(&batch);
            let tables = crate::wire::decode_batch(&bytes, &[0; Table::ALL.len()])
                .unwrap()
                .finish("r", rank)
                .tables;
            view.record("r", rank, &tables);
        }
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        let findings = Findings(Arc::new(move |s: &RunSnapshot| {
            let steps: Vec<usize> = s.ranks.iter().map(|r| r.steps.len()).collect();
            record.lock().unwrap().push(steps);
            vec![serde_json::json!({"kind": "seen"})]
        }));
        let live = LiveEndpoints::new(view, None).with_findings(Some(findings));
        let answer = live.snapshot("r", 32).unwrap();
        assert_eq!(*seen.lock().unwrap(), [vec![64, 64, 64]]);
        assert_eq!(answer.findings.len(), 1);
        let firsts: Vec<u64> = answer.ranks.iter().map(|r| r.steps[0].step).collect();
        assert_eq!(firsts, [106, 95, 86]);
        assert!(answer.ranks.iter().all(|r| r.steps.len() == 32));
        // A longer answer than the view keeps is what it keeps.
        let all = live.snapshot("r", 500).unwrap();
        assert!(all.ranks.iter().all(|r| r.steps.len() == 64));
    }

    #[test]
    fn query_values_are_percent_decoded() {
        assert_eq!(
            param("a=1&token=x%2By+z", "token").as_deref(),
            Some("x+y z")
        );
        assert_eq!(param("token=%zz%", "token").as_deref(), Some("%zz%"));
        assert_eq!(param("steps", "steps").as_deref(), Some(""));
        assert_eq!(param("", "steps"), None);
    }
}
