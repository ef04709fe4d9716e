//! Prometheus text exposition, parsed just enough to read series by name and labels.

/// One scrape of `/metrics`.
pub struct Metrics {
    pub text: String,
    samples: Vec<Sample>,
}

struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Metrics {
    /// Parses exposition text; panics on a sample line it cannot read.
    pub fn parse(text: &str) -> Metrics {
        let samples = text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(|line| parse_sample(line).unwrap_or_else(|| panic!("unreadable metrics line {line:?}")))
            .collect();
        Metrics { text: text.to_string(), samples }
    }

    /// The sum over every series of `name` carrying all of `labels` (other labels allowed); `None` if none does.
    pub fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let matching = self.samples.iter().filter(|s| {
            s.name == name && labels.iter().all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
        });
        matching.fold(None, |sum, s| Some(sum.unwrap_or(0.0) + s.value))
    }

    /// Like [`Metrics::find`], panicking (with the whole scrape) when no series matches.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.find(name, labels).unwrap_or_else(|| panic!("no series {name}{labels:?} in /metrics:\n{}", self.text))
    }

    /// The `# TYPE` declared for `name`.
    pub fn kind(&self, name: &str) -> Option<&str> {
        self.text.lines().find_map(|line| {
            let rest = line.strip_prefix("# TYPE ")?;
            let (metric, kind) = rest.split_once(' ')?;
            (metric == name).then_some(kind.trim())
        })
    }

    /// The sample lines of the metrics whose names start with `prefix`, histogram buckets left out, for failure
    /// messages.
    pub fn lines_of(&self, prefix: &str) -> String {
        let shown = |line: &&str| line.starts_with(prefix) && !line.contains("_bucket{");
        self.text.lines().filter(shown).collect::<Vec<_>>().join("\n")
    }
}

/// `name{k="v",...} value [timestamp]`.
fn parse_sample(line: &str) -> Option<Sample> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let (labels, after) = parse_labels(&line[open + 1..])?;
            (&line[..open], labels, after)
        }
        None => {
            let (name, rest) = line.split_once(char::is_whitespace)?;
            (name, Vec::new(), rest)
        }
    };
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample { name: name.to_string(), labels, value })
}

/// Reads `k="v",...}` and returns the labels and what follows the closing brace.
fn parse_labels(mut rest: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let (key, after_key) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after_key.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((key.trim().to_string(), value));
        rest = &after_key[end + 1..];
    }
}

fn parse_value(text: &str) -> Option<f64> {
    match text {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        other => other.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_found_by_name_and_labels() {
        let text = "# HELP x_total X.\n# TYPE x_total counter\nx_total{model=\"m\",finish_reason=\"stop\"} 3\n\
                    x_total{model=\"m\",finish_reason=\"length\"} 4\ngauge 2.5\n\
                    h_bucket{le=\"+Inf\"} 7\nesc{a=\"q\\\"}\"} 1\n";
        let metrics = Metrics::parse(text);
        assert_eq!(metrics.find("x_total", &[("finish_reason", "stop")]), Some(3.0));
        assert_eq!(metrics.find("x_total", &[]), Some(7.0));
        assert_eq!(metrics.find("x_total", &[("finish_reason", "error")]), None);
        assert_eq!(metrics.value("gauge", &[]), 2.5);
        assert_eq!(metrics.value("h_bucket", &[("le", "+Inf")]), 7.0);
        assert_eq!(metrics.value("esc", &[("a", "q\"}")]), 1.0);
        assert_eq!(metrics.kind("x_total"), Some("counter"));
    }
}
