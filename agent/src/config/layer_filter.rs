//! Which layers are sampled: `RANKSCOPE_LAYERS`, comma-separated name patterns
//! where `*` matches any run of characters.

/// Layer name patterns: comma-separated, `*` matches any run of characters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerFilter {
    patterns: Vec<String>,
}

impl LayerFilter {
    pub fn parse(text: &str) -> LayerFilter {
        LayerFilter {
            patterns: text
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect(),
        }
    }

    /// True for every name when there are no patterns.
    pub fn matches(&self, name: &str) -> bool {
        self.patterns.is_empty() || self.patterns.iter().any(|p| glob(p, name))
    }

    pub fn as_text(&self) -> String {
        self.patterns.join(",")
    }
}

fn glob(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(i) => rest = &rest[i + middle.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_patterns() {
        let f = LayerFilter::parse("blocks.*.mlp, head");
        assert!(f.matches("blocks.3.mlp"));
        assert!(f.matches("head"));
        assert!(!f.matches("blocks.3.attn"));
        assert!(!f.matches("heads"));
        assert!(LayerFilter::parse("").matches("anything"));
        assert!(LayerFilter::parse("*attn*").matches("layer.attn.q"));
    }
}
