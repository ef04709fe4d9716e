//! A small `strftime` for the `strftime_now` function chat templates call (e.g. Llama 3.1 writes
//! "Today Date: {{ strftime_now('%d %b %Y') }}"). Times are UTC: templates only need the date, and a
//! time-zone database is not worth a dependency here.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/// A UTC calendar time broken into fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CivilTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Sunday
    weekday: u32,
    /// 1..=366
    day_of_year: u32,
}

/// Formats the current UTC time.
pub(super) fn format_now_utc(fmt: &str) -> String {
    let secs = match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    };
    format_utc(fmt, secs)
}

/// Formats `unix_secs` (UTC) with the C `strftime` conversions templates use; unknown conversions are copied
/// through unchanged, as glibc does.
pub(super) fn format_utc(fmt: &str, unix_secs: i64) -> String {
    let t = civil_from_unix(unix_secs);
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some(spec) => push_conversion(&mut out, spec, &t),
            None => out.push('%'),
        }
    }
    out
}

fn push_conversion(out: &mut String, spec: char, t: &CivilTime) {
    let month_name = MONTHS[(t.month - 1) as usize];
    let weekday_name = WEEKDAYS[t.weekday as usize];
    let hour12 = match t.hour % 12 {
        0 => 12,
        h => h,
    };
    let s = match spec {
        'Y' => t.year.to_string(),
        'y' => format!("{:02}", t.year.rem_euclid(100)),
        'm' => format!("{:02}", t.month),
        'd' => format!("{:02}", t.day),
        'e' => format!("{:2}", t.day),
        'H' => format!("{:02}", t.hour),
        'I' => format!("{hour12:02}"),
        'M' => format!("{:02}", t.minute),
        'S' => format!("{:02}", t.second),
        'p' => (if t.hour < 12 { "AM" } else { "PM" }).to_string(),
        'B' => month_name.to_string(),
        'b' | 'h' => month_name[..3].to_string(),
        'A' => weekday_name.to_string(),
        'a' => weekday_name[..3].to_string(),
        'j' => format!("{:03}", t.day_of_year),
        'F' => format!("{}-{:02}-{:02}", t.year, t.month, t.day),
        'T' => format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second),
        '%' => "%".to_string(),
        other => format!("%{other}"),
    };
    out.push_str(&s);
}

/// Converts seconds since the epoch to a proleptic Gregorian UTC date (Howard Hinnant's `civil_from_days`).
fn civil_from_unix(unix_secs: i64) -> CivilTime {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400) as u32;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_march_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let march_month = (5 * day_of_march_year + 2) / 153;
    let day = (day_of_march_year - (153 * march_month + 2) / 5 + 1) as u32;
    let month = if march_month < 10 { march_month + 3 } else { march_month - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    CivilTime {
        year,
        month,
        day,
        hour: secs_of_day / 3600,
        minute: secs_of_day / 60 % 60,
        second: secs_of_day % 60,
        weekday: (days + 4).rem_euclid(7) as u32,
        day_of_year: day_of_year(year, month, day),
    }
}

fn day_of_year(year: i64, month: u32, day: u32) -> u32 {
    const DAYS_BEFORE_MONTH: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    DAYS_BEFORE_MONTH[(month - 1) as usize] + day + u32::from(leap && month > 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_is_thursday_first_of_january_1970() {
        assert_eq!(format_utc("%A %d %B %Y %H:%M:%S %j", 0), "Thursday 01 January 1970 00:00:00 001");
    }

    #[test]
    fn leap_day_and_afternoon() {
        // 2024-02-29T15:04:05Z
        let t = 1_709_219_045;
        assert_eq!(format_utc("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(format_utc("%F %T %I%p %a %y %e %j", t), "2024-02-29 15:04:05 03PM Thu 24 29 060");
    }

    #[test]
    fn end_of_leap_year_and_dates_before_the_epoch() {
        // 2000-12-31T23:59:59Z is day 366 of a leap year.
        assert_eq!(format_utc("%F %T %j", 978_307_199), "2000-12-31 23:59:59 366");
        assert_eq!(format_utc("%F %T %a", -1), "1969-12-31 23:59:59 Wed");
    }

    #[test]
    fn unknown_conversions_and_percent_pass_through() {
        assert_eq!(format_utc("%% %Q %", 0), "% %Q %");
    }
}
