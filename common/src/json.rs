//! One depth limit for every JSON value batchfleet accepts from outside (a
//! dataset line, a model answer, a reviewer's output). Records wrap these
//! values a few levels deep (a review entry holds the input, a result holds
//! the output); with inputs and outputs held to [`MAX_DEPTH`], every stored
//! record stays well inside the parser's own limit (128), so anything the
//! producer or a worker accepted can be read back by every tool.

use serde_json::Value;

/// The deepest nesting accepted in an input or an output (arrays and objects).
pub const MAX_DEPTH: usize = 64;

/// The nesting depth of a value: 0 for a scalar, 1 for a flat array or object.
pub fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            Value::Array(a) => {
                deepest = deepest.max(d + 1);
                stack.extend(a.iter().map(|x| (x, d + 1)));
            }
            Value::Object(o) => {
                deepest = deepest.max(d + 1);
                stack.extend(o.values().map(|x| (x, d + 1)));
            }
            _ => {}
        }
    }
    deepest
}

/// Whether a value nests deeper than [`MAX_DEPTH`].
pub fn too_deep(v: &Value) -> bool {
    depth(v) > MAX_DEPTH
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(n: usize) -> Value {
        let text = format!("{}1{}", "[".repeat(n), "]".repeat(n));
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn depth_counts_arrays_and_objects() {
        assert_eq!(depth(&serde_json::json!(1)), 0);
        assert_eq!(depth(&serde_json::json!({"a": [1, {"b": []}]})), 4);
        assert_eq!(depth(&nested(MAX_DEPTH)), MAX_DEPTH);
        assert!(!too_deep(&nested(MAX_DEPTH)));
        assert!(too_deep(&nested(MAX_DEPTH + 1)));
    }
}
